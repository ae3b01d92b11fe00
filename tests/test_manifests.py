"""The KubeRay manifests under clusters/ and the GB200 configs they run.

- KubeRay v1's structure: the fields each kind needs (`REQUIRED`: the CRDs' required fields, from ray-project/kuberay
  ray-operator/config/crd/bases/ray.io_{rayclusters,rayjobs,rayservices}.yaml, plus what this project relies on) and
  the operator's validation rules (ray-operator/controllers/ray/utils/validation.go) that these manifests touch.
- Placement: GPU groups advertise one Ray custom resource per GPU, and what each config asks (workers, placement
  bundles, the job's driver) fits the worker groups of the cluster it runs on.
- Links: every `python -m jobs.X` exists, every config a manifest names validates with its job's class, the
  RayService runs the router and the backend that `jobs.deploy` expects, import paths resolve.
- Security: Ray's token auth on every cluster, secrets only from Secrets (all documented in clusters/README.md), API
  keys mounted on every serving pod, NetworkPolicies that open only Serve's port to all.
"""

from __future__ import annotations

import importlib.machinery
import json
import re
from pathlib import Path

import pytest
import yaml

from orchestrator.serving.launch import app_bundles

REPO = Path(__file__).resolve().parents[1]
CLUSTERS = REPO / "clusters"
GPU_CONFIG_DIRS = ["configs/llama-3.1-8b", "configs/qwen3-32b", "configs/kimi-k2"]

DOCS = [(p.name, d) for p in sorted(CLUSTERS.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
RAY_KINDS = ("RayCluster", "RayJob", "RayService")

# Paths each kind must have (`[]`: every item of a list). KubeRay v1's CRDs (kuberay feeaf72) require
# headGroupSpec.template.spec.containers[].name, workerGroupSpecs[].{groupName, minReplicas, maxReplicas, template,
# template.spec.containers[].name} and a RayService's rayClusterConfig; a RayJob needs rayClusterSpec or
# clusterSelector (validation.go). The rest is what these manifests rely on: rayStartParams (custom resources,
# metrics port), replicas, every container's image and resource limits, the Serve config, the entrypoint.
_GROUP = ["rayStartParams", "template.spec.containers[].name", "template.spec.containers[].image"]
_GROUP += ["template.spec.containers[].resources.limits"]
CLUSTER_SPEC = [f"headGroupSpec.{p}" for p in _GROUP] + [
    f"workerGroupSpecs[].{p}" for p in ["groupName", "replicas", "minReplicas", "maxReplicas", *_GROUP]
]
REQUIRED = {
    "RayCluster": ["metadata.name", *(f"spec.{p}" for p in CLUSTER_SPEC)],
    "RayJob": ["metadata.name", "spec.entrypoint"],  # + rayClusterSpec or clusterSelector: see _cluster_of
    "RayService": ["metadata.name", "spec.serveConfigV2", *(f"spec.rayClusterConfig.{p}" for p in CLUSTER_SPEC)],
}
JOB_CONFIGS = {  # module -> (module, class) of its config
    "jobs.collect_hidden_states": ("orchestrator.data.collect", "CollectConfig"),
    "jobs.train_drafter": ("orchestrator.train.config", "TrainConfig"),
    "jobs.evaluate_drafter": ("orchestrator.evaluation.evaluate", "EvalConfig"),
    "jobs.deploy": ("orchestrator.serving.rollout", "DeployConfig"),
    "jobs.pipeline": ("orchestrator.pipeline", "PipelineConfig"),
    "jobs.adapt": ("jobs.adapt", "AdaptConfig"),
    "jobs.benchmark_serving": ("orchestrator.benchmarks.serving", "BenchmarkServingConfig"),
    "jobs.plan": ("orchestrator.sim.plan", "PlanConfig"),
}
CONFIG_JOBS = {  # a config file's name -> the job that reads it
    "collect": "jobs.collect_hidden_states",
    "train": "jobs.train_drafter",
    "evaluate": "jobs.evaluate_drafter",
    "deploy": "jobs.deploy",
    "pipeline": "jobs.pipeline",
    "adapt": "jobs.adapt",
    "benchmark_serving": "jobs.benchmark_serving",
    "plan": "jobs.plan",
    "plan-h200": "jobs.plan",
}
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}  # GPU nodes' usual taint
ENTRYPOINT = re.compile(r"^python -m (?P<module>[\w.]+) --config (?P<config>\S+)$")


def _of_kind(kind: str) -> list[tuple[str, dict]]:
    return [(f, d) for f, d in DOCS if d["kind"] == kind]


def _one(kind: str, name: str | None = None) -> dict:
    found = [d for _, d in _of_kind(kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def _missing(node, path: str, at: str = "") -> list[str]:
    """Where `path` ("a.b[].c") is absent in `node`."""
    if not path:
        return []
    head, _, rest = path.partition(".")
    key, each = (head[:-2], True) if head.endswith("[]") else (head, False)
    if not isinstance(node, dict) or node.get(key) in (None, "", [], {}):
        return [f"{at}{key}"]
    if not each:
        return _missing(node[key], rest, f"{at}{key}.")
    return [m for i, item in enumerate(node[key]) for m in _missing(item, rest, f"{at}{key}[{i}].")]


def _params(pairs: list[tuple[str, dict]]) -> list:
    return [pytest.param(where, value, id=where) for where, value in pairs]


def _cluster_specs() -> list[tuple[str, dict]]:
    """(where, RayCluster spec) of every Ray cluster the manifests define."""
    out = [(f, d["spec"]) for f, d in _of_kind("RayCluster")]
    out += [(f, d["spec"]["rayClusterConfig"]) for f, d in _of_kind("RayService")]
    return out + [(f, d["spec"]["rayClusterSpec"]) for f, d in _of_kind("RayJob") if "rayClusterSpec" in d["spec"]]


def _cluster_of(job: dict) -> dict:
    """The RayCluster spec a RayJob runs on: its own, or the RayCluster its clusterSelector names."""
    if "rayClusterSpec" in job["spec"]:
        return job["spec"]["rayClusterSpec"]
    return _one("RayCluster", job["spec"]["clusterSelector"]["ray.io/cluster"])["spec"]


def _groups(spec: dict) -> list[dict]:
    return [spec["headGroupSpec"], *spec["workerGroupSpecs"]]


def _pods(spec: dict) -> list[dict]:
    return [g["template"] for g in _groups(spec)]


def _custom_resources(group: dict) -> dict[str, int]:
    """rayStartParams.resources, read as Ray's KubeRay autoscaler reads it ('"{\\"draft\\": 4}"': quotes, escapes)."""
    raw = group["rayStartParams"].get("resources")
    if raw is None:
        return {}
    resources = json.loads(raw[1:-1].replace("\\", ""))
    assert all(isinstance(v, int) for v in resources.values()), raw
    return resources


def _cpu(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if str(quantity).endswith("m") else float(quantity)


def _capacity(group: dict) -> dict[str, float]:
    """What one pod of a group gives Ray: CPUs and GPUs from the container limits (KubeRay derives num-cpus and
    num-gpus from them), custom resources from rayStartParams."""
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    cpus = float(group["rayStartParams"].get("num-cpus", _cpu(limits["cpu"])))
    return {"CPU": cpus, "GPU": float(limits.get("nvidia.com/gpu", 0)), **_custom_resources(group)}


def _fits(demands: list[dict[str, float]], spec: dict) -> bool:
    """Whether `demands` (Ray resource bundles) pack, first fit decreasing, into the worker groups at maxReplicas."""
    free = [_capacity(g) for g in spec["workerGroupSpecs"] for _ in range(g["maxReplicas"])]
    for demand in sorted(demands, key=lambda d: (-d.get("GPU", 0), -d.get("CPU", 0))):
        pod = next((p for p in free if all(p.get(k, 0) >= v for k, v in demand.items())), None)
        if pod is None:
            return False
        for k, v in demand.items():
            pod[k] -= v
    return True


def _module_file(module: str) -> Path | None:
    """The source file of `module`, found by the import system's path finder without importing its packages
    (orchestrator.serving's __init__ imports Ray Serve and torch)."""
    spec, search = None, None
    for part in module.split("."):
        spec = importlib.machinery.PathFinder.find_spec(part, search)
        if spec is None:
            return None
        search = spec.submodule_search_locations
    return Path(spec.origin)


def _resolves(import_path: str) -> bool:
    module, _, attr = import_path.partition(":")
    source = _module_file(module)
    return source is not None and bool(re.search(rf"^(def|class) {attr}\b|^{attr}\s*[:=]", source.read_text(), re.M))


def _serve_config(doc: dict) -> dict:
    return yaml.safe_load(doc["spec"]["serveConfigV2"])


# -- KubeRay's structure -------------------------------------------------------------------------------------------


def test_the_manifests_are_the_ones_an_operator_applies():
    kinds = sorted((d["kind"], d["metadata"]["name"]) for _, d in DOCS)
    assert [k for k, _ in kinds] == [
        "NetworkPolicy", "NetworkPolicy", "PersistentVolumeClaim", "PodMonitor", "RayCluster",
        "RayJob", "RayJob", "RayJob", "RayJob", "RayJob", "RayJob", "RayService",
    ]  # fmt: skip
    for f, d in DOCS:
        assert d["apiVersion"] == "ray.io/v1" or d["kind"] not in RAY_KINDS, f
        assert d["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "aerie-spec", f
    entrypoints = {ENTRYPOINT.match(d["spec"]["entrypoint"])["module"] for _, d in _of_kind("RayJob")}
    # one RayJob per job (the benchmark: a stage; the plan: a simulation on any machine, no cluster)
    assert entrypoints == set(JOB_CONFIGS) - {"jobs.benchmark_serving", "jobs.plan"}


@pytest.mark.parametrize(
    "where,doc", _params([(f"{f}:{d['metadata']['name']}", d) for f, d in DOCS if d["kind"] in RAY_KINDS])
)
def test_ray_manifests_have_kuberays_required_fields(where, doc):
    missing = [m for p in REQUIRED[doc["kind"]] for m in _missing(doc, p)]
    if doc["kind"] == "RayJob":
        has_own, selector = "rayClusterSpec" in doc["spec"], doc["spec"].get("clusterSelector", {})
        assert has_own != bool(selector), f"{where}: one of rayClusterSpec or clusterSelector"
        if has_own:
            missing += [m for p in CLUSTER_SPEC for m in _missing(doc["spec"]["rayClusterSpec"], p)]
        else:
            _one("RayCluster", selector["ray.io/cluster"])  # the selected cluster is defined here
    assert not missing, f"{where}: {missing}"


@pytest.mark.parametrize("where,spec", _params(_cluster_specs()))
def test_ray_clusters_pass_kuberays_validation(where, spec):
    assert spec["authOptions"] == {"mode": "token", "secretName": "aerie-ray-token"}, where
    assert tuple(map(int, spec["rayVersion"].split("."))) >= (2, 52, 0), "token auth needs Ray 2.52+"
    for g in _groups(spec):
        assert "labels" not in g["rayStartParams"], "KubeRay 1.5+: group `labels`, not rayStartParams"
        assert not ("resources" in g and set(g["rayStartParams"]) & {"resources", "num-cpus", "num-gpus"})
        assert all(isinstance(v, str) for v in g["rayStartParams"].values()), "rayStartParams values are strings"
    for g in spec["workerGroupSpecs"]:
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], g["groupName"]


def test_rayjobs_pass_kuberays_validation():
    for where, job in _of_kind("RayJob"):
        spec = job["spec"]
        if not spec.get("shutdownAfterJobFinishes"):
            assert not spec.get("ttlSecondsAfterFinished"), f"{where}: TTL needs shutdownAfterJobFinishes"
        if "clusterSelector" in spec:
            assert not spec.get("backoffLimit"), f"{where}: no backoffLimit with clusterSelector"
        assert spec.get("submissionMode", "K8sJobMode") == "K8sJobMode", where
        if "entrypointResources" in spec:
            assert isinstance(json.loads(spec["entrypointResources"]), dict), where
        if "runtimeEnvYAML" in spec:
            assert "working_dir" not in yaml.safe_load(spec["runtimeEnvYAML"]), f"{where}: code comes from the image"


# -- nodes, placement, volumes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("where,spec", _params(_cluster_specs()))
def test_gpu_groups_are_gb200_trays_with_one_custom_resource_per_gpu(where, spec):
    head = _capacity(spec["headGroupSpec"])
    assert head["CPU"] == 0 and head["GPU"] == 0, f"{where}: no Ray work on the head"
    for g in spec["workerGroupSpecs"]:
        name, pod = g["groupName"], g["template"]["spec"]
        assert name in ("target", "draft"), where
        assert _custom_resources(g) == {name: _capacity(g)["GPU"]} and _capacity(g)["GPU"] > 0, f"{where}: {name}"
        assert g["labels"] == {"aerie/group": name}, f"{where}: {name}"
        assert {"nvidia.com/gpu.product", "kubernetes.io/arch"} <= set(pod["nodeSelector"]), f"{where}: {name}"
        assert GPU_TAINT in pod.get("tolerations", []), f"{where}: {name}"
    for pod in _pods(spec):
        assert pod["spec"]["nodeSelector"]["kubernetes.io/arch"] == "arm64", f"{where}: Grace CPUs are arm64"


def test_every_ray_pod_mounts_the_shared_claim_and_shm_at_the_same_paths():
    claims = {d["metadata"]["name"]: d["spec"] for _, d in _of_kind("PersistentVolumeClaim")}
    layouts, images, workdirs = set(), set(), set()
    for where, spec in _cluster_specs():
        for pod in _pods(spec):
            volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
            container = pod["spec"]["containers"][0]
            images.add(container["image"])
            workdirs.add(container.get("workingDir"))
            shared = []
            for m in container["volumeMounts"]:
                volume = volumes[m["name"]]
                if "persistentVolumeClaim" in volume:
                    claim = volume["persistentVolumeClaim"]["claimName"]
                    assert claim in claims, f"{where}: claim {claim} is not defined in clusters/"
                    assert "ReadWriteMany" in claims[claim]["accessModes"], claim
                    shared.append((claim, m["mountPath"], m.get("subPath")))
                if m["mountPath"] == "/dev/shm":
                    assert volume.get("emptyDir", {}).get("medium") == "Memory", where
            assert shared and "/dev/shm" in {m["mountPath"] for m in container["volumeMounts"]}, where
            layouts.add(tuple(sorted(shared)))
    assert len(layouts) == 1, f"the shared volume is mounted differently: {layouts}"
    assert len(images) == 1 and len(workdirs) == 1 and None not in workdirs, "one image, one working directory"


# -- jobs and configs ----------------------------------------------------------------------------------------------


def _validate(path: str):
    """A config file under configs/, validated as its job or application would (relative to the repository)."""
    import importlib

    from orchestrator.config import load_config
    from orchestrator.serving.launch import read_serve_config

    stem = Path(path).stem
    if stem.startswith("serve"):
        return read_serve_config(path)[1]
    module, cls = JOB_CONFIGS[CONFIG_JOBS[stem]]
    return load_config(getattr(importlib.import_module(module), cls), path)


@pytest.mark.parametrize("path", [str(p.relative_to(REPO)) for d in GPU_CONFIG_DIRS for p in (REPO / d).glob("*.yaml")])
def test_the_gb200_configs_validate_and_use_gpus(path, monkeypatch):
    monkeypatch.chdir(REPO)
    from orchestrator.serving.app import SpecServeConfig
    from orchestrator.serving.vllm_app import VllmServeConfig

    cfg, stem = _validate(path), Path(path).stem
    if stem == "serve":  # disaggregated: target and draft each on a GPU of their own group
        app = SpecServeConfig.model_validate(cfg["args"])
        assert app.dtype == "bfloat16" and app.max_model_len is not None
        for role, placement in (("target", app.target), ("draft", app.draft)):
            assert placement.num_gpus == 1 and placement.resources == {role: 1} and placement.torch_device() == "cuda"
    elif stem == "serve-vllm":
        app = VllmServeConfig.model_validate(cfg["args"])
        assert app.num_gpus == 1 and app.tensor_parallel_size == 4
    elif stem == "collect":
        assert cfg.worker.torch_device() == "cuda" and cfg.worker.resources == {"target": 1}
    elif stem == "train":
        assert cfg.worker.use_gpu and cfg.worker.resources == {"draft": 1} and cfg.precision == "bf16"
    elif stem == "deploy":
        assert _validate(cfg.app)["args"]["drafter"].endswith(f"@{cfg.production_alias}")  # what promotion moves


@pytest.mark.parametrize("model", ["llama-3.1-8b", "qwen3-32b"])
def test_one_drafter_travels_through_the_jobs_by_its_registry_name(model, monkeypatch):
    """collect writes what train reads; train registers NAME@candidate, evaluate and deploy take it, serving starts
    NAME@production (the alias jobs.deploy moves on promotion)."""
    monkeypatch.chdir(REPO)
    jobs = ("collect", "train", "evaluate", "deploy")
    collect, train, evaluate, deploy = (_validate(f"configs/{model}/{job}.yaml") for job in jobs)
    assert collect.output == train.data and collect.model == train.model == evaluate.model
    name = train.mlflow.registered_model
    assert "candidate" in train.mlflow.aliases and train.output.startswith("/runs/")
    assert [d.source for d in evaluate.drafters] == [f"models:/{name}@candidate"] and evaluate.data == train.data
    assert deploy.drafter == f"models:/{name}@candidate"
    serve = _validate(deploy.app)["args"]
    assert serve["drafter"] == f"models:/{name}@{deploy.production_alias}" and serve["model"] == train.model


def test_rayjob_entrypoints_run_existing_jobs_with_existing_configs():
    for where, job in _of_kind("RayJob"):
        m = ENTRYPOINT.match(job["spec"]["entrypoint"])
        assert m, f"{where}: entrypoint is `python -m jobs.X --config configs/...`"
        assert _module_file(m["module"]) is not None, f"{where}: no module {m['module']}"
        assert m["module"] in JOB_CONFIGS and (REPO / m["config"]).is_file(), where
        assert _resolves(":".join(JOB_CONFIGS[m["module"]])), m["module"]


def _demands(module: str, cfg) -> list[dict[str, float]]:
    """The Ray resource bundles a job's workers (or a deploy's two backends: stable and canary) ask for."""
    if module == "jobs.collect_hidden_states":
        w = cfg.worker
        return [{"CPU": w.num_cpus, "GPU": w.num_gpus, **w.resources}] * cfg.num_workers * cfg.tensor_parallel_size
    if module == "jobs.train_drafter":
        w = cfg.worker
        return [{"CPU": w.num_cpus, "GPU": float(w.use_gpu), **w.resources}] * cfg.num_workers
    if module == "jobs.deploy":
        return 2 * app_bundles(_validate(cfg.app))
    if module == "jobs.adapt":  # its training beside the backend it updates (and the canary: as jobs.deploy's)
        return app_bundles(_validate(_validate(cfg.deploy.config).app)) + _demands(
            "jobs.train_drafter", _stage(cfg, "train")
        )
    if module == "jobs.pipeline":  # its biggest stage beside the backend it updates (checked per stage below)
        return app_bundles(_validate(_validate(cfg.deploy.config).app)) + max(
            (
                _demands(m, _stage(cfg, key))
                for m, key in (("jobs.collect_hidden_states", "collect"), ("jobs.train_drafter", "train"))
            ),
            key=lambda d: sum(b.get("GPU", 0) for b in d),
        )
    return []


def _stage(cfg, key: str):
    """A pipeline stage's job config: its file with its overrides."""
    import importlib

    from orchestrator.config import load_config

    stage = getattr(cfg, key)
    module, cls = JOB_CONFIGS[CONFIG_JOBS[Path(stage.config).stem]]
    return load_config(getattr(importlib.import_module(module), cls), stage.config, stage.overrides)


@pytest.mark.parametrize("model", ["llama-3.1-8b", "qwen3-32b"])
@pytest.mark.parametrize("where,job", _params(_of_kind("RayJob")))
def test_what_each_job_asks_fits_the_cluster_it_runs_on(where, job, model, monkeypatch):
    """Its workers (deploy: two backends side by side) and its driver (entrypointNum*) on the worker groups at
    maxReplicas; Qwen3-32B's configs run on the same manifests with `--config` changed."""
    monkeypatch.chdir(REPO)
    m = ENTRYPOINT.match(job["spec"]["entrypoint"])
    cfg = _validate(m["config"].replace("llama-3.1-8b", model))
    spec = job["spec"]
    driver = {"CPU": spec.get("entrypointNumCpus", 0), "GPU": spec.get("entrypointNumGpus", 0)}
    driver.update(json.loads(spec.get("entrypointResources", "{}")))
    demands = _demands(m["module"], cfg) + ([driver] if any(driver.values()) else [])
    assert demands or m["module"] == "jobs.evaluate_drafter", where
    assert _fits(demands, _cluster_of(job)), f"{where}: {demands}"
    assert not _fits([{**d, "GPU": d.get("GPU", 0) + 64} for d in demands[:1]], _cluster_of(job))  # a real check


@pytest.mark.parametrize("model", ["llama-3.1-8b", "qwen3-32b"])
def test_every_pipeline_stage_fits_beside_the_backend_it_updates(model, monkeypatch):
    """On the shared cluster at maxReplicas: the serving backend, the pipeline's driver, and each stage in turn
    (collection, training, the candidate backend of the rollout, the benchmark's backend)."""
    monkeypatch.chdir(REPO)
    job = _one("RayJob", "aerie-pipeline-llama31-8b")
    cfg = _validate(f"configs/{model}/pipeline.yaml")
    spec = job["spec"]
    driver = {
        "CPU": spec["entrypointNumCpus"],
        "GPU": spec["entrypointNumGpus"],
        **json.loads(spec["entrypointResources"]),
    }
    serving = app_bundles(_validate(_stage(cfg, "deploy").app))
    stages = {
        "collect": _demands("jobs.collect_hidden_states", _stage(cfg, "collect")),
        "train": _demands("jobs.train_drafter", _stage(cfg, "train")),
        "canary": app_bundles(_validate(_stage(cfg, "deploy").app)),
        "benchmark": app_bundles(_validate(_stage(cfg, "benchmark").app)),
    }
    for name, demands in stages.items():
        assert _fits([driver, *serving, *demands], _cluster_of(job)), f"{model} {name}: {demands}"
    assert cfg.deploy.when == "always" and _stage(cfg, "train").num_workers == 4


def test_the_tensor_parallel_vllm_config_fits_one_tray_and_beside_llama(monkeypatch):
    monkeypatch.chdir(REPO)
    from orchestrator.serving.vllm_app import VllmServeConfig, placement

    cfg = VllmServeConfig.model_validate(_validate("configs/kimi-k2/serve-vllm.yaml")["args"])
    bundles = placement(cfg)[0]
    cluster = _one("RayCluster", "aerie")["spec"]
    one_tray = [{**cluster, "workerGroupSpecs": [{**g, "maxReplicas": 1}]} for g in cluster["workerGroupSpecs"]]
    assert len(bundles) == 4 and any(_fits(bundles, c) for c in one_tray)
    kimi, llama = _validate("configs/kimi-k2/deploy.yaml"), _validate("configs/llama-3.1-8b/deploy.yaml")
    assert kimi.route_prefix != llama.route_prefix and kimi.name != llama.name  # two routers on one Serve


# -- serving -------------------------------------------------------------------------------------------------------


def test_every_serve_config_names_import_paths_that_exist():
    docs = [_serve_config(d) for _, d in _of_kind("RayService")]
    docs += [yaml.safe_load(p.read_text()) for d in GPU_CONFIG_DIRS for p in (REPO / d).glob("serve*.yaml")]
    for config in docs:
        assert config["applications"]
        for app in config["applications"]:
            assert {"name", "import_path", "route_prefix"} <= set(app), app.get("name")
            assert _resolves(app["import_path"]), app["import_path"]
    assert not _resolves("orchestrator.serving.router:no_such_builder")  # a real check


def test_the_rayservice_runs_the_router_and_the_backend_jobs_deploy_rolls_out(monkeypatch):
    monkeypatch.chdir(REPO)
    from orchestrator.serving.router import BACKEND_PREFIX, RouterConfig

    service = _one("RayService")
    config = _serve_config(service)
    apps = {a["name"]: a for a in config["applications"]}
    deploy = _validate(ENTRYPOINT.match(_one("RayJob", "aerie-deploy-llama31-8b")["spec"]["entrypoint"])["config"])
    router = apps[deploy.name]
    assert router["import_path"] == "orchestrator.serving.router:build_router"
    assert router["route_prefix"] == deploy.route_prefix and config["http_options"]["port"] == deploy.port
    router_cfg = RouterConfig.model_validate(router["args"])
    # The router forwards to Serve's proxy on its own node (127.0.0.1): there must be one on every node.
    assert config["proxy_location"] == "EveryNode" and router_cfg.upstream.endswith(f":{deploy.port}")
    routes = router_cfg.routes
    assert {r.app for r in routes} == set(apps) - {deploy.name}, "the router routes to the backends served here"
    for r in routes:  # backends NAME-N at /_backends/NAME-N, as jobs.deploy names and routes them
        assert re.fullmatch(rf"{deploy.name}-\d+", r.app) and apps[r.app]["route_prefix"] == f"{BACKEND_PREFIX}/{r.app}"
        backend = _validate(deploy.app)  # the file jobs.deploy starts canaries from: the same application
        same = (apps[r.app]["import_path"], apps[r.app]["args"]) == (backend["import_path"], backend["args"])
        assert same, f"{r.app} differs from {deploy.app}'s application"
        assert _fits(2 * app_bundles(apps[r.app]), service["spec"]["rayClusterConfig"]), "stable + canary"


def test_serving_pods_mount_the_api_keys_from_their_secret():
    serving = [d["spec"] for _, d in _of_kind("RayCluster")] + [
        d["spec"]["rayClusterConfig"] for _, d in _of_kind("RayService")
    ]
    for spec in serving:  # token auth: test_ray_clusters_pass_kuberays_validation
        for pod in _pods(spec):
            volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
            container = pod["spec"]["containers"][0]
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            assert volumes["api-keys"]["secret"]["secretName"] == "aerie-api-keys"
            assert env["AERIE_API_KEY_FILE"].startswith(mounts["api-keys"])
            assert "AERIE_API_KEY" not in env and "RAY_AUTH_TOKEN" not in env  # keys only from Secrets


def test_every_secret_comes_from_a_secret_documented_in_the_readme():
    readme = (CLUSTERS / "README.md").read_text()
    referenced = set()
    for where, spec in _cluster_specs():
        referenced.add(spec["authOptions"]["secretName"])
        for pod in _pods(spec):
            referenced |= {v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}
            for c in pod["spec"]["containers"]:
                referenced |= {e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e}
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    referenced |= {ref["name"]} if ref else set()
                    secretish = re.search(r"KEY|TOKEN|SECRET|PASSWORD", e["name"]) and not e["name"].endswith("_FILE")
                    assert not (secretish and "value" in e), f"{where}: {e['name']} written into a manifest"
    assert referenced == {"aerie-ray-token", "aerie-api-keys", "aerie-secrets"}, referenced
    for name in referenced:  # how to create each one, with no value in any file
        assert re.search(rf"kubectl create secret generic {name} ", readme), f"{name} is not in clusters/README.md"


def test_network_policies_open_only_serves_port_to_all_and_metrics_to_prometheus():
    policies = {d["metadata"]["name"]: d["spec"] for _, d in _of_kind("NetworkPolicy")}
    monitor = _one("PodMonitor")["spec"]
    for spec in policies.values():
        open_to_all = [rule for rule in spec["ingress"] if "from" not in rule]
        assert [p["port"] for rule in open_to_all for p in rule["ports"]] == [8000]  # Serve only, not 8265/10001
        metrics = [r for r in spec["ingress"] if "ports" in r and "from" in r]
        assert [p["port"] for r in metrics for p in r["ports"]] == [8080]
        assert all("namespaceSelector" in f for r in metrics for f in r["from"])
    assert {spec["podSelector"]["matchLabels"]["ray.io/node-type"] for spec in policies.values()} == {"head", "worker"}
    selectors = [monitor["selector"]["matchLabels"]]  # KubeRay adds ray.io/node-type to every pod itself
    selectors += [
        {k: v for k, v in p["podSelector"]["matchLabels"].items() if k != "ray.io/node-type"} for p in policies.values()
    ]
    for where, spec in _cluster_specs():  # the policies and the PodMonitor select every Ray pod
        for pod, group in zip(_pods(spec), _groups(spec), strict=True):
            labels = pod["metadata"]["labels"]
            assert all(selector.items() <= labels.items() for selector in selectors), where
            assert group["rayStartParams"]["metrics-export-port"] == "8080", where  # KubeRay's port `metrics`
    assert [e["port"] for e in monitor["podMetricsEndpoints"]] == ["metrics"]
