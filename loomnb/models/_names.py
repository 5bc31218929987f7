"""Names the command line needs before torch is imported (``loomnb generate --help``)."""

MODEL = "SmolLM2-135M-Instruct"  # HuggingFaceTB's 135M-parameter instruction-tuned Llama
DEFAULT_SPECULATIVE_TOKENS = 4  # loomnb generate --speculative's drafts per target pass
# loomnb's exit codes: done; --check-reference found different tokens; a bad argument; interrupted
EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

# the ops backends (loomnb.models.backends); "torch" is the plain-torch speed baseline
BACKENDS = ("loomnb-cuda", "loomnb-cpu", "torch-reference", "torch")
# the memory-bound ops of the decode step that the loomnb backends run through loomnb
LOOMNB_OPS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding_and_cache",
              "paged_decode_attention", "silu_and_mul", "greedy_sample_logprob")
# the sampler ops a sampled decode adds (loomnb.models.sampling_params)
SAMPLER_OPS = ("apply_penalties_", "top_k_top_p_sampling_from_logits",
               "selected_token_logprob_rank")
SPECULATIVE_SAMPLER_OPS = ("top_k_top_p_sampling_from_logits", "chain_speculative_sampling",
                           "selected_token_logprob_rank")
# what torch computes in every backend
TORCH_OPS = ("embedding", "matmul (QKV, o_proj, gate_up, down, lm_head)", "prefill attention")
