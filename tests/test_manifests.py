"""The KubeRay manifests: Ray's token auth on, API keys from a Secret on every pod, no secret in the file."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def _docs(name: str) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all((REPO / "clusters" / name).read_text())}


def test_the_rayservice_turns_on_token_auth_and_mounts_the_api_keys_everywhere():
    docs = _docs("gb200-rayservice.yaml")
    cluster = docs["RayService"]["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token", "secretName": "aerie-ray-token"}
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        volumes = {v["name"]: v for v in pod["volumes"]}
        container = pod["containers"][0]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert volumes["api-keys"]["secret"]["secretName"] == "aerie-api-keys"
        assert env["AERIE_API_KEY_FILE"].startswith(mounts["api-keys"])
        assert "AERIE_API_KEY" not in env and "RAY_AUTH_TOKEN" not in env  # keys only from Secrets
    policy = docs["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"ray.io/node-type": "head"}
    open_to_all = [rule for rule in policy["ingress"] if "from" not in rule]
    assert [p["port"] for rule in open_to_all for p in rule["ports"]] == [8000]  # Serve only, not 8265/10001
