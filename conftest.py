# Repository-level pytest setup. Benchmarks (suites/bench, scripts run with python) and the
# downstream example (its own project) stay out of a plain `pytest`/`pytest suites` run;
# naming them explicitly on the command line still collects them.
collect_ignore = ["suites/bench", "examples"]
