"""The home suites declared in suites/suites.toml, readable without pytest.

suites/conftest.py and linattn-rerun both read them here, so a suite's needs live in one place.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from . import options

CONFIG = PurePosixPath("suites/suites.toml")

# The plugin options a suite may set, by key (the same in suites.toml); their flags and ini keys
# are the plugin table's.
OPTIONS = {key: options.OPTIONS[key] for key in ("tp", "cp", "device", "timeout", "fla_interpreted")}
_KEYS = set(OPTIONS) | {"gpus", "pytest_args", "collect", "description"}
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_SIZES = re.compile(r"^[1-9][0-9]*(,[1-9][0-9]*)*$")


class SuiteConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Suite:
    name: str
    gpus: int = 0
    device: str | None = None
    tp: str | None = None
    cp: str | None = None
    timeout: float | None = None
    fla_interpreted: str | None = None  # "on": fla's kernels under Triton's interpreter (--linattn-fla-interpreted)
    pytest_args: tuple[str, ...] = ()
    collect: bool = True
    description: str = ""

    def option_values(self) -> dict[str, str]:
        """The suite's pytest options that it sets, keyed by suite key, as command-line strings."""
        out = {}
        for key in OPTIONS:
            value = getattr(self, key)
            if value is not None:
                out[key] = _fmt(value)
        return out

    def pytest_options(self) -> list[str]:
        """The arguments linattn-rerun adds to pytest for this suite."""
        args = []
        for key, value in self.option_values().items():
            args += [OPTIONS[key].flag, value]
        return args + list(self.pytest_args)


def _fmt(value) -> str:
    # 300.0 -> "300": what a person would type.
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def find_root(start: Path | None = None) -> Path | None:
    """The nearest directory at or above start that holds suites/suites.toml."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / CONFIG).is_file():
            return d
    return None


def load_suites(root: Path) -> dict[str, Suite]:
    """Parse and check root/suites/suites.toml; suites keep the file's order."""
    path = Path(root) / CONFIG
    data = _parse_toml(path.read_text(encoding="utf-8"), path)
    suites = {}
    for name, table in data.items():
        if not _NAME.match(name) or not isinstance(table, dict):
            raise SuiteConfigError(f"{path}: [{name}]: a suite is a table named like its folder (a-z, 0-9, -)")
        suites[name] = _suite(name, table, path)
    return suites


def _suite(name: str, table: dict, path: Path) -> Suite:
    where = f"{path}: [{name}]"
    for key in table:
        if key not in _KEYS:
            raise SuiteConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(_KEYS))})")
    gpus = table.get("gpus", 0)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0:
        raise SuiteConfigError(f"{where}: gpus = {gpus!r}: must be an integer >= 0")
    for key in ("tp", "cp"):
        if key in table:
            table[key] = _fmt(table[key])
            if not _SIZES.match(table[key]):
                raise SuiteConfigError(f"{where}: {key} = {table[key]!r}: one size or a comma list, e.g. \"2,4\"")
    if "device" in table and table["device"] not in options.DEVICES:
        raise SuiteConfigError(f"{where}: device = {table['device']!r}: one of {', '.join(options.DEVICES)}")
    interpret = table.get("fla_interpreted")
    if interpret is not None and (not isinstance(interpret, str) or interpret not in options.SWITCH_VALUES):
        raise SuiteConfigError(f"{where}: fla_interpreted = {interpret!r}: \"on\" or \"off\"")
    timeout = table.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise SuiteConfigError(f"{where}: timeout = {timeout!r}: seconds, a number > 0")
    args = table.get("pytest_args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise SuiteConfigError(f"{where}: pytest_args must be a list of strings")
    collect = table.get("collect", True)
    if not isinstance(collect, bool):
        raise SuiteConfigError(f"{where}: collect = {collect!r}: true or false")
    return Suite(name=name, gpus=gpus, device=table.get("device"), tp=table.get("tp"), cp=table.get("cp"),
                 timeout=timeout, fla_interpreted=interpret, pytest_args=tuple(args), collect=collect,
                 description=str(table.get("description", "")))


def home_suite(path: Path, root: Path, suites: dict[str, Suite]) -> str | None:
    """The suite folder that path lives in, or None when it is outside suites/<name>/."""
    try:
        rel = Path(path).resolve().relative_to((Path(root) / "suites").resolve())
    except ValueError:
        return None
    return rel.parts[0] if len(rel.parts) > 1 and rel.parts[0] in suites else None


def targeted_suites(args: list[str], invocation_dir: Path, root: Path, suites: dict[str, Suite]) -> set[str]:
    """Which collectable suites a pytest run over args (paths or node ids) can reach."""
    suites_dir = (Path(root) / "suites").resolve()
    collectable = {n for n, s in suites.items() if s.collect}
    out = set()
    for arg in args:
        path = (Path(invocation_dir) / arg.split("::")[0]).resolve()
        if path == suites_dir or path in suites_dir.parents:
            out |= collectable  # suites/ itself or a folder above it
            continue
        name = home_suite(path, root, suites)
        if name is None and path.parent == suites_dir and path.name in suites:
            name = path.name  # the suite folder itself
        if name in collectable:
            out.add(name)
    return out


def given_flags(tokens: list[str]) -> set[str]:
    """Which of the suite option flags appear in a pytest argument list (`--tp 2` or `--tp=2`)."""
    flags = {option.flag for option in OPTIONS.values()}
    return {t.split("=", 1)[0] for t in tokens if t.split("=", 1)[0] in flags}


def split_addopts(text: str) -> list[str]:
    return shlex.split(text) if text else []


# --- TOML: tomllib on Python >= 3.11; below it a reader for the subset suites.toml uses ---

def _parse_toml(text: str, path: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return _parse_mini_toml(text, path)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SuiteConfigError(f"{path}: {e}") from None


_TABLE = re.compile(r"^\[([A-Za-z0-9_-]+)\]$")
_PAIR = re.compile(r"^([A-Za-z0-9_-]+)\s*=\s*(.+)$")


def _parse_mini_toml(text: str, path: Path) -> dict:
    """[table] headers and key = string | integer | float | bool | [strings], one per line."""
    import ast

    data: dict = {}
    table = None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if m := _TABLE.match(line):
            table = data.setdefault(m.group(1), {})
            continue
        m = _PAIR.match(line)
        if not m or table is None:
            raise SuiteConfigError(f"{path}:{n}: {line!r}: expected [suite] or key = value inside a suite")
        value = m.group(2).split(" #")[0].strip()
        if value in ("true", "false"):
            table[m.group(1)] = value == "true"
            continue
        try:
            table[m.group(1)] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise SuiteConfigError(f"{path}:{n}: {value!r}: not a string, number, boolean or list") from None
    return data
