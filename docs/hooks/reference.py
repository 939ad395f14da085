"""mkdocs hook: the reference page (docs/reference.md) filled in from the code's own tables when the
site is built, so it cannot drift from the code.

    <!-- reference: options -->   pytest_linattn.options.OPTIONS: flag, ini key, default, help
    <!-- reference: markers -->   pytest_linattn.plugin.MARKERS
    <!-- reference: fixtures -->  the plugin's fixtures and their docstrings
    <!-- reference: api -->       the public functions and classes (API below) with signatures and docstrings
    <!-- reference: rerun -->     linattn-rerun's --help

A placeholder the hook does not know, or a public name that is gone, fails the build.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import re

# module -> the names documented: "__all__" for the module's own list
API = {
    "pytest_linattn": "__all__",
    "pytest_linattn.seqlens": ["packed_seqlens", "fragment_seqlens"],
    "pytest_linattn.float64": ["float64_reference"],
    "linattn.reference": "__all__",
    "linattn.emulation": ["fla_on_cpu", "fla_interpreted", "active_modes"],
    "linattn.layers": "__all__",
    "linattn.parallel": ["new_groups", "new_pipeline_group"],
    "linattn.parallel.cp": ["cp_shard", "cp_unshard"],
    "linattn.selection": ["short_conv_backend", "kda_tilelang_setting", "gdn_route"],
}
PLACEHOLDER = re.compile(r"<!-- reference: (\w+) -->")


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != "reference.md":
        return markdown

    def fill(match):
        what = match.group(1)
        if what not in SECTIONS:
            raise ValueError(f"reference.md: unknown placeholder {match.group(0)!r}")
        return SECTIONS[what]()

    return PLACEHOLDER.sub(fill, markdown)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _doc(obj) -> str:
    """The docstring as written (plain text, its indentation kept)."""
    text = inspect.cleandoc(obj.__doc__ or "(no docstring)")
    return "```text\n" + re.sub(r"``([^`]+)``", r"`\1`", text) + "\n```"


def options() -> str:
    from pytest_linattn.options import OPTIONS

    rows = ["| flag | ini key | default | what |", "| --- | --- | --- | --- |"]
    for o in OPTIONS.values():
        flag = f"`{o.flag} {o.metavar}`" if o.metavar else f"`{o.flag}`"
        choices = " (" + " \\| ".join(o.choices) + ")" if o.choices else ""
        default = "unset" if o.default is None else f"`{o.default}`"
        rows.append(f"| {flag}{choices} | `{o.ini}` | {default} | {_cell(o.help)} |")
    return "\n".join(rows)


def markers() -> str:
    from pytest_linattn.plugin import MARKERS

    rows = ["| marker | what |", "| --- | --- |"]
    for line in MARKERS:
        name, _, what = line.partition(": ")
        rows.append(f"| `@pytest.mark.{name}` | {_cell(what)} |")
    return "\n".join(rows)


def fixtures() -> str:
    from pytest_linattn import plugin

    out = []
    for name, obj in vars(plugin).items():
        if type(obj).__name__ == "FixtureFunctionDefinition" and not name.startswith("_"):
            out += [f"### `{name}`", "", _doc(obj), ""]
    return "\n".join(out)


def api() -> str:
    out = []
    for module_name, names in API.items():
        module = importlib.import_module(module_name)
        out += [f"### `{module_name}`", ""]
        for name in (module.__all__ if names == "__all__" else names):
            obj = getattr(module, name)  # AttributeError: a documented name is gone
            if not (inspect.isclass(obj) or callable(obj)):
                out += [f"#### `{module_name}.{name}`", "", f"`{obj!r}`", ""]
                continue
            try:
                signature = re.sub(r" at 0x[0-9a-f]+>", ">", str(inspect.signature(obj)))
            except (TypeError, ValueError):
                signature = "(...)"
            kind = "class " if inspect.isclass(obj) else ""
            out += [f"#### `{module_name}.{name}`", "", "```python", f"{kind}{name}{signature}", "```", "",
                    _doc(obj), ""]
    return "\n".join(out)


def rerun() -> str:
    from pytest_linattn.rerun import _parser

    parser = _parser()
    with contextlib.redirect_stdout(io.StringIO()) as text:
        parser.print_help()
    return "```text\n" + text.getvalue().rstrip() + "\n```"


SECTIONS = {"options": options, "markers": markers, "fixtures": fixtures, "api": api, "rerun": rerun}
