"""Case tables and the rank functions that run them, shared by the tests of several suites: layer
parity, CP ops, the emulated ops, fla's families, the staged transport's ops, the GPU suites' preamble."""
