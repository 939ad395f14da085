"""gpu-1's compile groups (suites/gpu-1/conftest.py) name tests that exist, and the hook marks
gpu-1's items only: a renamed test or case would otherwise fall into "other" and compile beside
its twin in another process, and a CPU test must never be grouped."""

import ast
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from cases.layer_parity import BF16_CASES

GPU1 = Path(__file__).resolve().parents[2] / "gpu-1"


def _conftest():
    spec = importlib.util.spec_from_file_location("gpu1_conftest", GPU1 / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _test_names_and_case_ids() -> list[str]:
    """Every test function of gpu-1 as `file::name` and every case id (OP_CASES keys, BF16_CASES), as `[id]`."""
    names = [f"[{case}]" for case in BF16_CASES]
    for path in GPU1.glob("test_*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                names.append(f"{path.name}::{node.name}")  # an entry may name the file too
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "OP_CASES" for t in node.targets):
                names += [f"[{key.value}]" for key in node.value.keys]
    return names


def test_every_compile_group_entry_names_a_gpu1_test():
    names = _test_names_and_case_ids()
    assert any(n.startswith("[chunk_kda") for n in names) and "test_kernels_gpu1.py::test_kda_matches_reference" in names
    stale = [(group, entry) for group, entries in _conftest().COMPILE_GROUPS.items()
             for entry in entries if not any(entry in name for name in names)]
    assert not stale, f"compile group entries that match no gpu-1 test or case: {stale}"


def test_the_hook_groups_gpu1_items_only(tmp_path):
    conftest = _conftest()

    def item(path, nodeid):
        marks = []
        return SimpleNamespace(path=path, nodeid=nodeid, marks=marks, add_marker=marks.append)

    ours = item(GPU1 / "test_kernels_gpu1.py", "suites/gpu-1/test_kernels_gpu1.py::test_kda_matches_reference[4-8]")
    cheap = item(GPU1 / "test_kernels_gpu1.py", "suites/gpu-1/test_kernels_gpu1.py::test_short_conv[cuda]")
    cpu = item(tmp_path / "test_x.py", "test_x.py::test_kda_matches_reference")
    conftest.pytest_collection_modifyitems([ours, cheap, cpu])
    assert [m.args for m in ours.marks] == [("chunk_kda",)]
    assert [m.args for m in cheap.marks] == [("other",)]
    assert cpu.marks == []
    assert all(m.name == "xdist_group" for m in ours.marks + cheap.marks)


@pytest.mark.parametrize("nodeid, group", [
    ("x.py::test_emulated_op_matches_fla_kernel[chunk_gdn-decay-h0-l2norm]", "chunk_gdn"),
    ("x.py::test_bf16_layer_matches_float64[kda-gva2-lower_bound]", "chunk_kda_safe_gate"),
    ("x.py::test_emulated_op_matches_fla_kernel[l2norm]", "other"),
])
def test_compile_group_of_a_test_id(nodeid, group):
    assert _conftest().compile_group(nodeid) == group
