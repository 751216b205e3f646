"""The worker's configuration records: `EngineConfig` (operator knobs) and `ModelConfig` (model shape).

Plain dataclasses, so the `config` package can fill them from settings without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LAYER_LINEARS = ("qkv", "o", "gate_up", "down")  # a decoder layer's linears, by attribute name
CPU_PREFILL_STEP_TOKENS = 64  # `prefill_step_tokens`'s auto on CPU (docs/engine.md, "Prefill steps")

@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    # Tokens per step: decodes first, the rest to prefill chunks. Larger steps make
    # bigger matmuls (better CPU efficiency) at the cost of inter-token latency.
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 64
    kv_cache_bytes: int | None = None  # CPU budget; None => default_cpu_kv_bytes
    gpu_memory_fraction: float = 0.85
    dtype: str = "auto"  # "auto" | "bfloat16" | "float32" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    enable_prefix_cache: bool = True
    cache_aware_order: bool = False
    # "vtc": fair share between fairness keys within a priority class | "fifo": arrival order
    fairness: str = "vtc"
    # VTC with more than one fairness key seen lately: prefill tokens per step are capped here, so a key that
    # arrives waits behind a short step at most (TTFT tail for light tenants vs step efficiency; 0: no cap)
    fair_step_tokens: int = 0
    # A step that already carries a prefill takes another request's only while the step's uncached prefill
    # tokens stay within this (the first is never held): a burst of arrivals gets its first tokens one after
    # another, not all at the end of one long step (TTFT mean and median vs step count; 0: no cap; None: auto,
    # CPU_PREFILL_STEP_TOKENS on CPU, where a prefill of more tokens than the machine's FLOP/byte balance is
    # compute-bound and batching it only delays the earlier request, and no cap on CUDA, not measured there)
    prefill_step_tokens: int | None = None
    # "auto" | "triton" (CUDA) | "flash_attn" (CUDA, pages a multiple of 256 tokens) | "torch" (CPU: with the
    # C++ decode and prefill kernels when they build) | "torch_reference"; auto's rule:
    # worker.model.backends.choose_backend
    attention_backend: str = "auto"
    # decode-only steps replay CUDA graphs captured per batch-size bucket (worker.model.cuda_graphs); CUDA
    # only, no effect on CPU
    cuda_graphs: str = "on"
    num_threads: int | None = None  # torch intra-op threads on CPU; None => leave as is
    # "on": a layer's elementwise ops fused (C++ passes on CPU, Triton kernels on CUDA) | "off": eager torch
    # reference
    fused_ops: str = "on"
    # CUDA, decode batches of up to 64 rows: add + RMSNorm and SiLU·mul fused into the projections that follow
    # them (worker.kernels.triton_gemv; three kernels fewer per layer). "on" | "off" | "auto", which is off
    # until a device run measures the kernels (checked under Triton's interpreter only; docs/gpu.md)
    fused_linear: str = "auto"
    # weights: "none" | "int8" | "int4" | "w8a8" | "fp8" (CUDA 8.9+) | "auto" (applied by the loader;
    # worker.quant.weights)
    quantization: str = "none"
    default_cpu_kv_bytes: int = 1 << 30
    # KV pages: "model" (the model's dtype) | "int8" (8-bit pages with per page and kv head scales, CPU with
    # the torch backend; about 2x the tokens per byte) | "auto" (the model's dtype:
    # worker.model.kv_dtype.resolve_kv_dtype says why)
    kv_dtype: str = "model"
    # KV tiers below the radix cache (worker.kvcache.tiers, docs/engine.md "KV tiers"): evicted pages kept in
    # host RAM, up to kv_host_bytes (None: auto, 1/8 of the memory available at start, see
    # worker.engine.scheduling.restore.default_host_bytes; 0: off), and on disk under kv_disk_dir (None: no
    # disk tier) up to kv_disk_bytes, for pages hit at least kv_disk_min_hits times
    kv_host_bytes: int | None = None
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 16 << 30
    kv_disk_min_hits: int = 1
    # n-gram speculative decoding (worker.engine.scheduling.speculative): up to spec_tokens proposals per
    # decoding sequence, from matches of its last spec_ngram_max..spec_ngram_min tokens; only while the step's
    # decode batch is at most spec_max_batch sequences (0 turns it off)
    spec_tokens: int = 4
    spec_ngram_max: int = 3
    spec_ngram_min: int = 1
    spec_max_batch: int = 4
    # structured outputs: grammars compile on a thread pool while their requests wait
    # (worker.engine.scheduling.grammar_wait); new compiles past these pending bounds are refused with a
    # retryable error
    grammar_max_pending: int = 16
    grammar_max_pending_per_ns: int = 4
    grammar_compile_timeout_s: float = 10.0

    def validate(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError("gpu_memory_fraction must be in (0, 1]")
        if self.dtype not in ("auto", "bfloat16", "float32", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.attention_backend not in ("auto", "triton", "flash_attn", "torch", "torch_reference"):
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}")
        if self.cuda_graphs not in ("on", "off"):
            raise ValueError(f"cuda_graphs must be 'on' or 'off', got {self.cuda_graphs!r}")
        if self.quantization not in ("none", "int8", "int4", "w8a8", "fp8", "auto"):
            raise ValueError(f"unknown quantization {self.quantization!r}; choose one of none, int8, int4, "
                             "w8a8, fp8, "
                             "auto")
        if self.kv_dtype == "fp8":
            raise ValueError("--kv-dtype fp8 is not supported: there are no fp8 KV kernels; use --kv-dtype "
                             "int8 (CPU) "
                             "or model")
        if self.kv_dtype not in ("auto", "model", "int8"):
            raise ValueError(f"unknown kv_dtype {self.kv_dtype!r}; choose one of auto, model, int8")
        if self.fused_ops not in ("on", "off"):
            raise ValueError(f"fused_ops must be 'on' or 'off', got {self.fused_ops!r}")
        if self.fused_linear not in ("auto", "on", "off"):
            raise ValueError(f"fused_linear must be auto, on or off, got {self.fused_linear!r}")
        if not 0 <= self.spec_tokens <= 16 or self.spec_max_batch < 0:
            raise ValueError("spec_tokens must be in [0, 16] and spec_max_batch >= 0")
        if not 1 <= self.spec_ngram_min <= self.spec_ngram_max <= 8:
            raise ValueError("spec n-gram sizes must satisfy 1 <= spec_ngram_min <= spec_ngram_max <= 8")
        if self.fair_step_tokens < 0:
            raise ValueError("fair_step_tokens must be >= 0 (0: no cap)")
        if self.prefill_step_tokens is not None and self.prefill_step_tokens < 0:
            raise ValueError("prefill_step_tokens must be >= 0 (0: no cap)")
        if (self.grammar_max_pending < 1 or self.grammar_max_pending_per_ns < 1
                or self.grammar_compile_timeout_s <= 0):
            raise ValueError("grammar pending bounds must be >= 1 and the compile timeout > 0")
        if (self.kv_host_bytes or 0) < 0 or self.kv_disk_bytes <= 0 or self.kv_disk_min_hits < 0:
            raise ValueError("kv_host_bytes must be >= 0, kv_disk_bytes > 0 and kv_disk_min_hits >= 0")
        if self.fairness not in ("vtc", "fifo"):
            raise ValueError(f"fairness must be 'vtc' or 'fifo', got {self.fairness!r}")


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF form, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    extra: dict = field(default_factory=dict)

    def num_params(self) -> int:
        """Weight count of the decoder (embedding and LM head counted once if tied)."""
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h
