"""The pinned releases' kernel files: fetched as the wheel recorded them, and a missing or changed
one refused by name (the file and the release), never a bare ImportError."""

import shutil

import pytest

from clients.engines.fetch import RELEASES, SGLANG, VLLM, is_fetched
from clients.engines.loader import EngineFilesError, check_files, load_sglang, load_vllm, missing_reason


def copy_release(release, base):
    shutil.copytree(release.folder(), release.folder(base))
    return release.folder(base)


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.engine)
def test_fetched_files_are_the_releases(release):
    if missing_reason(release):
        pytest.skip(missing_reason(release))
    assert is_fetched(release) and check_files(release) == release.folder()


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.engine)
def test_a_missing_or_changed_kernel_file_is_named(release, tmp_path):
    if missing_reason(release):
        pytest.skip(missing_reason(release))
    folder = copy_release(release, tmp_path)
    kernel = release.carried[0]
    (folder / kernel).write_text((folder / kernel).read_text() + "\n# edited\n")
    with pytest.raises(EngineFilesError, match=rf"^{release.name}: kernel file {kernel} was changed"):
        check_files(release, tmp_path)
    (folder / kernel).unlink()
    with pytest.raises(EngineFilesError, match=rf"^{release.name}: kernel file {kernel} is missing from .*fetch.py"):
        check_files(release, tmp_path)
    assert missing_reason(release, tmp_path).startswith(f"{release.name}: kernel file {kernel} is missing")


def test_a_release_never_fetched_says_how(tmp_path):
    with pytest.raises(EngineFilesError, match=r"^vllm 0.33.0: its kernel files were not fetched .*fetch.py"):
        check_files(VLLM, tmp_path)


def test_a_module_outside_the_fetched_files_is_named():
    if missing_reason(VLLM) or missing_reason(SGLANG):
        pytest.skip("the releases were not fetched")
    with pytest.raises(EngineFilesError, match=r"^vllm 0.33.0: importing vllm.v1.attention.backends.gdn_attn from"):
        load_vllm("vllm.v1.attention.backends.gdn_attn")
    with pytest.raises(EngineFilesError, match=r"^sglang 0.5.23: importing sglang.kernels.ops.attention.fla.layernorm_gated"):
        load_sglang("sglang.kernels.ops.attention.fla.layernorm_gated")
