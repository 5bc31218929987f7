"""loomnb inside other software. Each integration is a module imported on its own, never by
``import loomnb``, and imports the software it plugs into lazily:

* :mod:`loomnb.integrations.vllm` -- a vLLM 0.24 general plug-in (entry point
  ``vllm.general_plugins: loomnb``) that routes vLLM's RMSNorm ops, and SiLU-and-mul / RoPE where
  loomnb has them, to loomnb's kernels. ``docs/vllm.md`` shows how to turn it on.
"""
