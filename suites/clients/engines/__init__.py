"""The serving engines' own kernels (vLLM's, sglang's), pinned, as clients of the serving checks:
`fetch` (the pinned releases and the kernel files fetched from them), `loader` (those files
imported standalone), `layout` (the engines' state layout), `vllm_gdn` and `vllm_kda` (vLLM's GDN
and KDA paths on a state pool, GDN's speculative decoding), `sglang_gdn` (sglang's GDN path)."""
