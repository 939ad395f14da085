"""The engines suite: vLLM's and sglang's own serving kernels (the pinned releases' files, fetched
by `python suites/clients/engines/fetch.py` into .engines/) as clients of the serving checks, under
Triton's interpreter, float32, on a CPU.

suites.toml gives it ``--linattn-fla-interpreted on``: TRITON_INTERPRET=1 and linattn's interpreter
patches are set at session start, before any kernel is defined, in this process and in the ranks
spawn starts. So it needs a pytest process of its own: ``pytest suites/engines``. A test whose
release was not fetched skips, saying so and how to fetch it. The interpreter's warnings are
quieted by the plugin in that mode.
"""
