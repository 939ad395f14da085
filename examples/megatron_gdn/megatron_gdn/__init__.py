"""megatron-core 0.19.2 GatedDeltaNet on a CPU: the shims (cpu) and the parity harness client (client)."""
