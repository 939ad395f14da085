"""Clients: layers, serving paths and decoder stacks written the way a user of the plugin would write
them (on linattn, on fla, on transformers), for the harness to check. Not the project's layers."""
