"""Render the Helm chart and validate every manifest against the Kubernetes JSON schemas.

Run by deploy/validate.sh (CI). Exits 1 on any render error or invalid manifest.
Uses `helm-python-sdk` (Helm's Go SDK through ctypes: no helm binary) and `kubernetes-validate`.
"""

from __future__ import annotations

import pathlib
import sys

import helm_python as helm
import kubernetes_validate
import yaml

CHART = pathlib.Path(__file__).parent / "helm" / "deepserve"
VALUE_SETS = {"defaults": None, "all-on": CHART / "ci" / "all-on-values.yaml", "lws": CHART / "ci" / "lws-values.yaml",
              "router": CHART / "ci" / "router-values.yaml",
              "router-external-redis": CHART / "ci" / "router-external-redis-values.yaml"}
KUBE_VERSIONS = ("1.29.0", "1.37.0")  # the oldest and newest the chart claims, with the schemas at hand
# CRDs have no schema in kubernetes-validate (it ships the core API only): these are checked for their
# identity fields only. Their full validation needs the CRDs installed (kubectl apply --dry-run=server).
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject"),
             ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")}


def render(values_file: pathlib.Path | None) -> list[dict]:
    values = helm.values_from_yaml(values_file.read_text()) if values_file else None
    rendered = helm.Chart.load(str(CHART)).render(values, name="deepserve", namespace="llm", is_install=True)
    return [doc for text in rendered.values() for doc in yaml.safe_load_all(text) if doc]


def check(doc: dict, kube_version: str) -> str | None:
    """None when valid, else the reason."""
    if doc.get("kind") == "LeaderWorkerSet":
        return check_lws(doc, kube_version)
    if (doc.get("apiVersion"), doc.get("kind")) in CRD_KINDS:
        ok = doc.get("metadata", {}).get("name") and isinstance(doc.get("spec"), dict)
        return None if ok else "custom resource without metadata.name or spec"
    try:
        kubernetes_validate.validate(doc, kube_version, strict=True)  # strict: unknown fields are errors
    except kubernetes_validate.ValidationError as exc:
        return f"{'.'.join(str(p) for p in exc.path)}: {exc.message}"
    except kubernetes_validate.SchemaNotFoundError as exc:
        return str(exc)
    return None


def check_lws(doc: dict, kube_version: str) -> str | None:
    """The LeaderWorkerSet's two pod templates against the Pod schema, and the multi-node flags they pass:
    the leader is node 0, each worker node $(LWS_WORKER_INDEX), all with --nnodes = the group size."""
    spec = doc.get("spec", {}).get("leaderWorkerTemplate", {})
    size = str(spec.get("size"))
    for role, rank in (("leaderTemplate", "0"), ("workerTemplate", "$(LWS_WORKER_INDEX)")):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": role.lower()},
               "spec": spec.get(role, {}).get("spec")}
        problem = check(pod, kube_version)
        if problem:
            return f"{role}: {problem}"
        args = pod["spec"]["containers"][0].get("args", [])
        flags = dict(zip(args[1::2], args[2::2], strict=False)) if args else {}
        want = {"--nnodes": size, "--node-rank": rank, "--master-addr": "$(LWS_LEADER_ADDRESS)"}
        wrong = {k: flags.get(k) for k, v in want.items() if flags.get(k) != v}
        if wrong:
            return f"{role}: multi-node flags {wrong}, expected {want}"
    return None


def main() -> int:
    # The validator must be able to fail: a Deployment with a string for replicas is rejected.
    broken = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
              "spec": {"replicas": "two", "selector": {}, "template": {}}}
    assert check(broken, KUBE_VERSIONS[-1]) is not None, "validator accepted an invalid manifest"
    failures = 0
    for label, values_file in VALUE_SETS.items():
        try:
            docs = render(values_file)
        except helm.HelmError as exc:
            print(f"FAIL render {label}: {exc}")
            failures += 1
            continue
        for version in KUBE_VERSIONS:
            for doc in docs:
                problem = check(doc, version)
                name = f"{label} k8s {version} {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
                print(f"{'FAIL' if problem else 'ok  '} {name}{': ' + problem if problem else ''}")
                failures += problem is not None
    print(f"{failures} invalid manifest(s)" if failures else "all manifests valid")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
