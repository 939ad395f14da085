"""megatron-core 0.19.2 GatedDeltaNet on a CPU: the shims (cpu), the parity harness client (client)
and Megatron's training step around it for the training-step harness (training)."""
