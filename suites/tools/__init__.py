"""Process tools of the suites themselves: pytest run inside a test (inner_pytest) and a python that
starts warm (warm_python)."""
