"""The public bug record as code: one registry entry per reported sharding or state bug
(`registry.BUGS`), the bug's mechanism planted where it lived (`plants_layer`: linattn's layer and
its shard code; `plants_state`: the state path's calls and small client layers), and the check
that must catch it (`checks`). suites/cpu/record runs them; `write_bugs_md` turns a run into
docs/bugs.md (`run_results`: the run and its reports read into rows; `render_bugs_md`: the page)."""
