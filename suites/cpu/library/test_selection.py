"""Every branch of the kernel choice, over injected facts; the wrappers over the real (CPU) facts."""

import logging
import os
import sys
from dataclasses import replace

import pytest

from linattn import selection
from linattn.selection import (Facts, choose_gate_norm_backend, choose_gdn_route, choose_kda_tilelang,
                               choose_short_conv_backend)

BLACKWELL = dict(cuda_available=True, capability=(10, 0), triton_version="3.6.0")
HOPPER = dict(cuda_available=True, capability=(9, 0), triton_version="3.6.0")
AMPERE = dict(cuda_available=True, capability=(8, 0), triton_version="3.6.0")


# ---- short conv --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["triton", "mix", "cuda"])
def test_conv_env_wins(name):
    # the variable wins even over a machine that would pick something else
    for facts in (Facts(**HOPPER, causal_conv1d_bwd_importable=True), Facts()):
        choice = choose_short_conv_backend(replace(facts, env={"FLA_CONV_BACKEND": name}))
        assert choice.value == name
        assert "FLA_CONV_BACKEND" in choice.reason


@pytest.mark.parametrize("bad", ["torch", "Triton", "", "cuda "])
def test_conv_bad_env_names_allowed_values(bad):
    with pytest.raises(ValueError, match="FLA_CONV_BACKEND.*triton, mix, cuda"):
        choose_short_conv_backend(Facts(**HOPPER, env={"FLA_CONV_BACKEND": bad}))


def test_conv_cuda_when_causal_conv1d_imports():
    assert choose_short_conv_backend(Facts(**HOPPER, causal_conv1d_bwd_importable=True)).value == "cuda"


def test_conv_triton_when_causal_conv1d_missing():
    assert choose_short_conv_backend(Facts(**HOPPER, causal_conv1d_bwd_importable=False)).value == "triton"


def test_conv_torch_on_cpu_only():
    # an importable package without CUDA does not make its CUDA kernels usable
    assert choose_short_conv_backend(Facts(causal_conv1d_bwd_importable=True)).value == "torch"


# ---- KDA backward: FLA_TILELANG -----------------------------------------------------------

@pytest.mark.parametrize("capability", [(10, 0), (10, 3), (12, 0)])
def test_kda_tilelang_off_on_blackwell_by_default(capability):
    choice = choose_kda_tilelang(Facts(**{**BLACKWELL, "capability": capability}))
    assert choice.value == "0"


@pytest.mark.parametrize("facts", [Facts(**HOPPER), Facts(**AMPERE), Facts()], ids=["hopper", "ampere", "cpu"])
def test_kda_tilelang_default_kept_below_blackwell(facts):
    assert choose_kda_tilelang(facts).value is None


@pytest.mark.parametrize("explicit", ["1", "0"])
@pytest.mark.parametrize("base", [BLACKWELL, HOPPER], ids=["blackwell", "hopper"])
def test_kda_tilelang_explicit_value_wins(explicit, base):
    choice = choose_kda_tilelang(Facts(**base, env={"FLA_TILELANG": explicit}))
    assert choice.value == explicit
    assert "explicit" in choice.reason


# ---- GDN route -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "triton_version, route",
    [
        ("3.3.1", "gated_delta_rule"),
        ("3.4.0", "kda"),
        ("3.6.0", "kda"),
        ("3.7.0+git5a1b", "kda"),
        ("3.7.1", "gated_delta_rule"),
        ("3.8.0", "gated_delta_rule"),
        (None, "gated_delta_rule"),
    ],
)
def test_gdn_route_per_triton_band_on_hopper(triton_version, route):
    assert choose_gdn_route(Facts(**{**HOPPER, "triton_version": triton_version})).value == route


def test_gdn_route_direct_for_a_forward_only_call():
    # fla refuses only the backward: a call that records no gradient runs the gated delta rule
    assert choose_gdn_route(Facts(**HOPPER), needs_backward=True).value == "kda"
    assert choose_gdn_route(Facts(**HOPPER), needs_backward=False).value == "gated_delta_rule"


@pytest.mark.parametrize("facts, value", [
    (Facts(**HOPPER, fla_installed=True), "fla"),
    (Facts(**BLACKWELL, fla_installed=True), "fla"),
    (Facts(**HOPPER, fla_installed=False), "torch"),
    (Facts(fla_installed=True), "torch"),  # a CPU: fla's kernels cannot run
])
def test_gate_norm_backend(facts, value):
    assert choose_gate_norm_backend(facts).value == value


@pytest.mark.parametrize("base", [BLACKWELL, AMPERE], ids=["blackwell", "ampere"])
def test_gdn_route_direct_off_hopper(base):
    assert choose_gdn_route(Facts(**base)).value == "gated_delta_rule"


def test_gdn_route_direct_on_cpu():
    assert choose_gdn_route(Facts(triton_version="3.6.0")).value == "gated_delta_rule"


def test_gdn_route_direct_when_tilelang_takes_the_backward():
    assert choose_gdn_route(Facts(**HOPPER, tilelang_usable=True)).value == "gated_delta_rule"
    assert choose_gdn_route(Facts(**HOPPER, tilelang_usable=True, env={"FLA_TILELANG": "1"})).value == "gated_delta_rule"


@pytest.mark.parametrize("env", [{"FLA_TILELANG": "0"}, {"FLA_DISABLE_BACKEND_DISPATCH": "1"}])
def test_gdn_route_kda_when_tilelang_disabled(env):
    assert choose_gdn_route(Facts(**HOPPER, tilelang_usable=True, env=env)).value == "kda"


def test_version_tuple_rejects_garbage():
    assert selection.version_tuple("3.7") == (3, 7, 0)
    with pytest.raises(ValueError, match="version"):
        selection.version_tuple("nightly")


# ---- the wrappers over this machine's facts -----------------------------------------------

@pytest.fixture
def fresh_wrappers(monkeypatch):
    for name in selection.RELEVANT_ENV:
        # setenv first so monkeypatch restores the original (possibly absent) value afterwards,
        # also undoing what kda_tilelang_setting writes into os.environ
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)
    wrappers = (selection.short_conv_backend, selection.kda_tilelang_setting, selection.gdn_route,
                selection.gate_norm_backend)
    for wrapper in wrappers:
        wrapper.cache_clear()
    yield
    for wrapper in wrappers:
        wrapper.cache_clear()


def test_read_facts_imports_neither_fla_nor_triton(monkeypatch):
    monkeypatch.setenv("FLA_CONV_BACKEND", "mix")
    monkeypatch.setenv("UNRELATED_SECRET", "x")
    before = {name for name in sys.modules if name.split(".")[0] in ("fla", "triton")}
    facts = selection.read_facts()
    after = {name for name in sys.modules if name.split(".")[0] in ("fla", "triton")}
    assert after == before
    assert facts.env == {"FLA_CONV_BACKEND": "mix"}


def test_wrappers_cache_and_log_once(fresh_wrappers, monkeypatch, caplog):
    monkeypatch.setenv("FLA_CONV_BACKEND", "cuda")
    with caplog.at_level(logging.INFO, logger="linattn.selection"):
        assert selection.short_conv_backend() == "cuda"
        monkeypatch.setenv("FLA_CONV_BACKEND", "triton")  # cached: the first answer stays
        assert selection.short_conv_backend() == "cuda"
        route = selection.gdn_route()
        selection.gdn_route()
    records = [r.getMessage() for r in caplog.records if r.name == "linattn.selection"]
    assert records == [
        "short conv backend: cuda (FLA_CONV_BACKEND=cuda is set)",
        f"gated delta rule route: {route} ({choose_gdn_route(selection.read_facts()).reason})",
    ]


def test_kda_tilelang_setting_applies_the_choice(fresh_wrappers, monkeypatch):
    blackwell = Facts(**BLACKWELL)
    monkeypatch.setattr(selection, "read_facts", lambda: blackwell)
    assert selection.kda_tilelang_setting() == "0"
    assert os.environ["FLA_TILELANG"] == "0"


def test_kda_tilelang_setting_keeps_an_explicit_value(fresh_wrappers, monkeypatch):
    monkeypatch.setenv("FLA_TILELANG", "1")
    facts = Facts(**{**BLACKWELL, "env": {"FLA_TILELANG": "1"}})
    monkeypatch.setattr(selection, "read_facts", lambda: facts)
    assert selection.kda_tilelang_setting() == "1"
    assert os.environ["FLA_TILELANG"] == "1"


def test_short_conv_backend_bad_env_raises(fresh_wrappers, monkeypatch):
    monkeypatch.setenv("FLA_CONV_BACKEND", "fast")
    with pytest.raises(ValueError, match="triton, mix, cuda"):
        selection.short_conv_backend()
