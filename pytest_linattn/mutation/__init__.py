"""Collective mutation testing (``--linattn-mutate-collectives``): would a distributed test notice
a communication bug? After a test that runs ranks passes, every collective its ranks issued is
perturbed, one mutant per run (skipped, doubled, averaged, reordered, zeroed, stale...: the table
in `mutations`), the same way on every rank, and the perturbations the test did not notice are
reported by call site (docs/mutation.md).

    mutations   the table: each mutation, what it does, the bug class it stands for
    rank        on every rank: the TorchDispatchMode over c10d / _c10d_functional that records and mutates
    sites       where a collective was issued (its call site and caller): how mutants and reports name it
    plan        in the test process: the runs, the mutants from a clean run, outcomes
    report      per-test scores, the session table, collective-mutants.json
    reruns      references kept across a test's reruns (computed once in the test process)
    recorder    the pytest plugin object that ties them to a pytest run
"""
