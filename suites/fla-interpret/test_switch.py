"""The switch itself (linattn.emulation.fla_interpreted, the fixture, --linattn-fla-interpreted):
this process runs fla's kernels interpreted, a process that imported fla first and a Triton whose
internals moved are refused in one line, bfloat16 is refused where the interpreter computes it
wrong. (The ranks' side: test_cp_fidelity.py checks every rank is interpreted.)"""

import os
import re
import subprocess
import sys
import types

import pytest
import torch

pytest_plugins = ["pytester"]


def test_this_process_runs_fla_interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    from linattn.emulation import active_modes, fla_on_cpu, interpreted

    import fla.ops.kda.chunk_intra as module

    assert os.environ["TRITON_INTERPRET"] == "1"
    assert interpreted.compiled_fla_kernel() is None
    kernel = module.chunk_kda_fwd_kernel_intra_sub_chunk
    while not isinstance(kernel, InterpretedFunction):  # autotune / heuristics wrappers
        kernel = kernel.fn
    assert active_modes() == {"interpreted": True, "fla_on_cpu": None}
    with fla_on_cpu():
        assert active_modes() == {"interpreted": True, "fla_on_cpu": torch.float64}


def compiled_kernel(x):  # a kernel's body; never run
    return x


def test_header_says_the_kernels_are_interpreted(pytestconfig):
    from pytest_linattn.fla_hint import header_line

    assert "linattn fla-interpreted: on, in every test and rank" in header_line(pytestconfig)


def test_fla_imported_first_is_refused_in_one_line(monkeypatch):
    """A process whose fla kernels are compiled (imported before TRITON_INTERPRET=1) cannot run them."""
    from triton.runtime.jit import JITFunction

    from linattn.emulation import interpreted

    fake = types.ModuleType("fla._linattn_compiled_probe")
    fake.kernel = JITFunction(compiled_kernel)
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setitem(interpreted._state, "process_ready", False)
    with pytest.raises(RuntimeError) as info:
        interpreted.prepare_process()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("fla_interpreted: fla was imported in this process before TRITON_INTERPRET=1")
    assert "fla._linattn_compiled_probe.kernel" in message and "--linattn-fla-interpreted" in message


@pytest.mark.parametrize("moved", ["autotuner", "interpreter"])
def test_triton_internals_not_where_expected_fail_in_one_line(monkeypatch, moved):
    import triton
    from triton.runtime import autotuner, interpreter

    from linattn.emulation import interpreted

    if moved == "autotuner":
        monkeypatch.delattr(autotuner.Autotuner, "prune_configs")
    else:
        monkeypatch.delattr(interpreter, "ASTTransformer")
    monkeypatch.setitem(interpreted._state, "process_ready", False)
    monkeypatch.setitem(interpreted._state, "triton_patched", False)
    with pytest.raises(RuntimeError) as info:
        interpreted.prepare_process()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"fla_interpreted: Triton {triton.__version__}: triton.runtime.")
    assert message.endswith(f"(the interpreter patches were written for Triton {interpreted.TRITON_WRITTEN_FOR})")


def test_failed_self_check_fails_in_one_line_and_undoes_the_patches(monkeypatch):
    from triton.runtime import autotuner, interpreter

    from linattn.emulation import _interpreter_check, interpreted

    before = (autotuner.Autotuner.prune_configs, interpreter.ASTTransformer.visit_For, interpreter._patch_lang)

    def broken():
        raise ValueError("a kernel computed nonsense\nsecond line")

    monkeypatch.setattr(_interpreter_check, "run", broken)
    with pytest.raises(RuntimeError, match=r"fails its self-check kernels: ValueError: a kernel computed nonsense \(") as info:
        interpreted._patch_triton()
    assert "\n" not in str(info.value)
    assert (autotuner.Autotuner.prune_configs, interpreter.ASTTransformer.visit_For, interpreter._patch_lang) == before


def test_bfloat16_is_refused_where_the_interpreter_computes_it_wrong():
    from linattn.emulation import interpreted

    from fla.modules.norm.l2norm import l2norm

    if not interpreted._state["bf16_refused"]:
        pytest.skip("this Triton's interpreter computes bfloat16 dots right: nothing refused")
    with pytest.raises(TypeError, match=r"kernel l2norm_fwd_kernel got a bfloat16 tensor \(x\): .* float32"):
        l2norm(torch.randn(1, 4, 2, 16, dtype=torch.bfloat16))
    assert l2norm(torch.randn(1, 4, 2, 16)).dtype == torch.float32  # float32 runs


FRESH = r'''
def test_fixture_in_a_process_without_the_option(fla_interpreted):
    import torch
    from fla.modules.norm.l2norm import l2norm

    x = torch.randn(1, 4, 2, 16)
    assert torch.allclose(l2norm(x), torch.nn.functional.normalize(x, dim=-1), atol=1e-6)
'''


def _start_pytest(folder, *args):
    """A cold `python -m pytest` in `folder` (this test's environment), running while the caller goes on."""
    return subprocess.Popen([sys.executable, "-m", "pytest", "-p", "pytest_linattn", "-q", "-p", "no:cacheprovider",
                             *args], cwd=folder, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_fixture_without_the_option_and_an_early_fla_import(pytester, monkeypatch):
    """In a fresh process: the fixture alone sets the process up when fla is not imported yet;
    with the option, a conftest that imports fla first is a usage error naming the cause.
    The two processes run at once: each spends its seconds importing fla."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the fresh process decides for itself
    fresh, early = pytester.mkdir("fresh"), pytester.mkdir("early")
    (fresh / "test_fresh.py").write_text(FRESH)
    (early / "test_fresh.py").write_text(FRESH)
    (early / "conftest.py").write_text("import fla.ops.kda\n")
    runs = [_start_pytest(fresh), _start_pytest(early, "--linattn-fla-interpreted")]
    (fresh_out, fresh_err), (early_out, early_err) = [run.communicate(timeout=600) for run in runs]
    assert runs[0].returncode == pytest.ExitCode.OK, fresh_out + fresh_err
    assert re.search(r"^1 passed", fresh_out, re.MULTILINE), fresh_out
    assert runs[1].returncode == pytest.ExitCode.USAGE_ERROR, early_out + early_err
    assert "fla_interpreted: fla was imported in this process before TRITON_INTERPRET=1" in early_err, early_err
