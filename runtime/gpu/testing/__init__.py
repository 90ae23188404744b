"""Test support: tiny random checkpoints per model family, StepPlan builders, oracles (transformers'
logits and greedy text) and the DeepSeek-V4 prefix-hit harness. Used by the unit, integration and gpu
tests and by a few loadgen tools that need a real (tiny, fast) model directory."""

from runtime.gpu.testing.deepseek import (
    V4_CSA,
    V4_HCA,
    V4_SLIDING,
    V4_TINY_CONFIGS,
    YARN_ROPE,
    assert_router_matches,
    assert_same_decode,
    decode_scenario,
    load_into_reference,
    random_deepseek_v3,
    random_deepseek_v4,
    save_tiny_deepseek_v2,
    save_tiny_deepseek_v3,
    save_tiny_deepseek_v4,
    tiny_deepseek_v2_config,
    tiny_deepseek_v3_config,
    tiny_deepseek_v4_config,
    write_fp8_checkpoint,
)
from runtime.gpu.testing.llama import save_tiny_llama, tiny_llama_config
from runtime.gpu.testing.oracles import TOKENIZER_FILES, copy_tokenizer, greedy_chat_texts, reference_logits
from runtime.gpu.testing.plans import (
    GREEDY,
    PagedPlanBuilder,
    PlanBuilder,
    decode_step_without_syncs,
    prefill_then_decode,
    random_prompt,
    seq_start,
    shuffled_slots,
)
from runtime.gpu.testing.v4_decode import v4_decode_scenario, v4_verify_scenario
from runtime.gpu.testing.v4_prefix import HitVsCold, v4_hit_vs_cold

__all__ = [
    "GREEDY",
    "TOKENIZER_FILES",
    "V4_CSA",
    "V4_HCA",
    "V4_SLIDING",
    "V4_TINY_CONFIGS",
    "YARN_ROPE",
    "HitVsCold",
    "PagedPlanBuilder",
    "decode_step_without_syncs",
    "PlanBuilder",
    "prefill_then_decode",
    "copy_tokenizer",
    "assert_router_matches",
    "assert_same_decode",
    "decode_scenario",
    "greedy_chat_texts",
    "load_into_reference",
    "random_deepseek_v3",
    "random_deepseek_v4",
    "random_prompt",
    "reference_logits",
    "save_tiny_deepseek_v2",
    "save_tiny_deepseek_v3",
    "save_tiny_deepseek_v4",
    "save_tiny_llama",
    "seq_start",
    "shuffled_slots",
    "tiny_deepseek_v2_config",
    "tiny_deepseek_v3_config",
    "tiny_deepseek_v4_config",
    "tiny_llama_config",
    "v4_decode_scenario",
    "v4_verify_scenario",
    "v4_hit_vs_cold",
    "write_fp8_checkpoint",
]
