"""The layers of the package, lowest first: a module imports only from its own layer or the ones below it.

`tests/test_layout.py` keeps the code to this order and `docs/reference/layers.md` is generated from it, so the
architecture page and the imports cannot disagree. A module belongs to the first layer with a prefix that names
it (longest prefix wins); the `data` package is split because its readers and writers of files sit low while its
collection jobs drive engines.
"""

from __future__ import annotations

# (name, what lives there, module prefixes)
LAYERS: list[tuple[str, str, list[str]]] = [
    (
        "foundation",
        "errors, config loading, redaction, fingerprints, files published whole, the bootstrap statistics every "
        "report uses, and the console (what a person sees; each stage's log file takes the rest)",
        [
            "orchestrator.errors",
            "orchestrator.console",
            "orchestrator.config",
            "orchestrator.redaction",
            "orchestrator.fingerprint",
            "orchestrator.files",
            "orchestrator.stats",
            "orchestrator.layout",
        ],
    ),
    (
        "models",
        "the target and drafter networks, checkpoints (safetensors and JSON only), tokenizers, devices",
        ["orchestrator.models"],
    ),
    (
        "storage",
        "files, S3, hidden-state shards, corpora, prompt sets, the traffic tap, MLflow tracking, Ray cluster set-up "
        "(and a cluster of network namespaces for tests and demos)",
        ["orchestrator.data", "orchestrator.tracking", "orchestrator.cluster", "orchestrator.netcluster"],
    ),
    (
        "algorithms",
        "speculation without Ray: trees, drafting, lossless verification, sampling, acceptance",
        ["orchestrator.spec"],
    ),
    (
        "runtime",
        "draft and target workers, the cross-user scheduler, its policies and metrics",
        ["orchestrator.runtime"],
    ),
    (
        "engine",
        "the in-process speculative engine and the vLLM backend behind one interface",
        ["orchestrator.engine"],
    ),
    (
        "capabilities",
        "what the jobs are made of: collection, training, evaluation, serving, benchmarks, the simulator",
        [
            "orchestrator.data.collect",
            "orchestrator.data.synthetic",
            "orchestrator.data.vllm_capture",
            "orchestrator.train",
            "orchestrator.evaluation",
            "orchestrator.benchmarks",
            "orchestrator.serving",
            "orchestrator.sim",
        ],
    ),
    (
        "entry points",
        "the pipeline, its report, the demos, the command line, job submission, the vLLM plugin",
        [
            "orchestrator.pipeline",
            "orchestrator.pipeline_report",
            "orchestrator.demo",
            "orchestrator.cluster_demo",
            "orchestrator.adapt_demo",
            "orchestrator.canary_demo",
            "orchestrator.cli",
            "orchestrator.jobrunner",
            "orchestrator.vllm_plugin",
            "orchestrator.reference",
        ],
    ),
]


def layer_of(module: str) -> int:
    """The index in LAYERS of the layer that holds `module` (longest matching prefix); ValueError if none."""
    best, length = None, -1
    for index, (_, _, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = index, len(prefix)
    if best is None:
        raise ValueError(f"{module} is in no layer of orchestrator/layout.py: add its prefix to LAYERS")
    return best
