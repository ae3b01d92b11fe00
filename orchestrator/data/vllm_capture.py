"""Hidden-state capture through vLLM's `extract_hidden_states` speculative method (the production path on GPU).

vLLM caches the requested layers' hidden states in a cache-only layer and a KV connector writes them out when
a request finishes. Its example connector copies through CUDA streams into pinned memory, which fails on a
CPU build; `CpuHiddenStatesConnector` does the same copy synchronously. vLLM loads it by module path.

The final-norm state is not among vLLM's aux layers: it is captured as layer N (the last decoder layer's
output) and normalised here with the target's final RMSNorm weight.
"""

from __future__ import annotations

import os
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


class VllmCapture:
    """Aux and final-norm hidden states of whole sequences through a vLLM engine."""

    def __init__(self, model_dir: str | Path, aux_layer_ids: tuple[int, ...], max_model_len: int = 4096) -> None:
        if ExampleHiddenStatesConnector is object:
            raise AerieError("backend 'vllm' needs vLLM installed (pip install -e '.[cpu]' or '.[gpu]')")
        import vllm

        from orchestrator.models.target import read_hf_config

        hf = read_hf_config(model_dir)
        self.num_aux = len(aux_layer_ids)
        layers = list(aux_layer_ids) + [hf["num_hidden_layers"]]
        self.out_dir = tempfile.mkdtemp(prefix="aerie-vllm-hidden-")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        try:
            self.llm = vllm.LLM(
                model=str(model_dir),
                dtype="float32",
                enforce_eager=True,
                max_model_len=max_model_len,
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
        from orchestrator.models.target import load_safetensors_dir

        self.norm_weight = load_safetensors_dir(Path(model_dir))["model.norm.weight"].float()
        self.eps = hf.get("rms_norm_eps", 1e-6)

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
