"""Live bugs of the pinned releases: the registry, the standalone repros and the page's generator
(docs/live-bugs.md). The repros are scripts run with python, never collected as tests."""
