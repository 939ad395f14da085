"""Picks the fla mode of the whole run before anything imports transformers (see
transformers_tp/__init__.py): fla absent, or fla emulated with `--linattn-fla-on-cpu` (or the ini
key `linattn_fla_on_cpu = on`). The environment variable carries the mode to spawn's ranks,
which start later, from this process."""

import os

_ON = {"on", "true", "1", "yes"}


def pytest_configure(config):
    value = config.getoption("linattn_fla_on_cpu", None) or config.getini("linattn_fla_on_cpu") or "off"
    emulated = value is True or str(value).strip().lower() in _ON
    os.environ["TRANSFORMERS_TP_FLA"] = "emulated" if emulated else "absent"
    import transformers_tp  # noqa: F401  - applies the mode in this process (blocks fla when absent)


def pytest_report_header(config):
    return f"transformers_tp: fla {os.environ['TRANSFORMERS_TP_FLA']} (transformers imported in this mode, ranks too)"
