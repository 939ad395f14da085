"""Fetch the serving engines' kernel files, pinned: `python suites/clients/engines/fetch.py`.

Downloads the pinned wheels of vLLM and sglang (`pip download --no-deps`, the wheels only, for
CPython 3.11 on x86-64 Linux whatever runs this), checks their sha256, and unpacks only the
kernel files the engine clients load (`CARRIED`) into `.engines/<engine>-<version>/` at the
repository's root (ignored by git), with `files.sha256`: each carried file's hash from the
wheel's own RECORD, which the loader checks before every import. The wheels are deleted after.
Idempotent: a release whose files are all there with their recorded hashes is left alone.
Standard library only (it runs before anything else is set up).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ENGINES_DIR = ROOT / ".engines"
MANIFEST = "files.sha256"


@dataclass(frozen=True)
class Release:
    engine: str
    version: str
    wheel: str
    sha256: str
    carried: tuple

    @property
    def name(self) -> str:
        return f"{self.engine} {self.version}"

    def folder(self, base: Path = ENGINES_DIR) -> Path:
        return base / f"{self.engine}-{self.version}"


VLLM = Release(
    "vllm", "0.33.0", "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
    "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
    (
        # GDN recurrence (decode, spec decode, chunked prefill) and the helpers they import
        "vllm/third_party/flash_linear_attention/ops/fused_recurrent.py",
        "vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py",
        "vllm/third_party/flash_linear_attention/ops/chunk.py",
        "vllm/third_party/flash_linear_attention/ops/chunk_delta_h.py",
        "vllm/third_party/flash_linear_attention/ops/chunk_o.py",
        "vllm/third_party/flash_linear_attention/ops/chunk_scaled_dot_kkt.py",
        "vllm/third_party/flash_linear_attention/ops/cumsum.py",
        "vllm/third_party/flash_linear_attention/ops/index.py",
        "vllm/third_party/flash_linear_attention/ops/l2norm.py",
        "vllm/third_party/flash_linear_attention/ops/op.py",
        "vllm/third_party/flash_linear_attention/ops/solve_tril.py",
        "vllm/third_party/flash_linear_attention/ops/utils.py",
        "vllm/third_party/flash_linear_attention/ops/wy_fast.py",
        # KDA (Kimi Linear): recurrent decode and chunked prefill, gates in the kernels
        "vllm/models/kimi_k3/nvidia/ops/third_party/kda/__init__.py",
        "vllm/models/kimi_k3/nvidia/ops/third_party/kda/chunk.py",
        "vllm/models/kimi_k3/nvidia/ops/third_party/kda/chunk_intra.py",
        "vllm/models/kimi_k3/nvidia/ops/third_party/kda/chunk_intra_token_parallel.py",
        "vllm/models/kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py",
        # short conv with slots (prefill and decode)
        "vllm/model_executor/layers/mamba/ops/causal_conv1d.py",
        # what those import, real and unchanged
        "vllm/envs.py",
        "vllm/logger.py",
        "vllm/logging_utils/__init__.py",
        "vllm/logging_utils/formatter.py",
        "vllm/logging_utils/lazy.py",
        "vllm/logging_utils/log_time.py",
        "vllm/logging_utils/torch_tensor.py",
        "vllm/logging_utils/uvicorn_logging.py",
        "vllm/utils/gpu_sync_debug.py",
        "vllm/utils/math_utils.py",
        "vllm/utils/platform_utils.py",
        "vllm/utils/torch_utils.py",
        "vllm/utils/torch_version.py",
    ))

SGLANG = Release(
    "sglang", "0.5.23", "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
    "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937",
    (
        "sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py",
        "sglang/kernels/ops/attention/fla/fused_recurrent.py",
        "sglang/kernels/ops/attention/fla/chunk.py",
        "sglang/kernels/ops/attention/fla/chunk_delta_h.py",
        "sglang/kernels/ops/attention/fla/chunk_fwd.py",
        "sglang/kernels/ops/attention/fla/chunk_o.py",
        "sglang/kernels/ops/attention/fla/cumsum.py",
        "sglang/kernels/ops/attention/fla/index.py",
        "sglang/kernels/ops/attention/fla/l2norm.py",
        "sglang/kernels/ops/attention/fla/op.py",
        "sglang/kernels/ops/attention/fla/utils.py",
        "sglang/kernels/ops/attention/fla/wy_fast.py",
        "sglang/kernels/ops/mamba/causal_conv1d_triton.py",
        # KDA's chunked prefill (chunk_kda) and what it imports
        "sglang/kernels/ops/attention/fla/kda.py",
        "sglang/kernels/ops/attention/fla/chunk_intra.py",
        "sglang/kernels/ops/attention/fla/chunk_intra_token_parallel.py",
        "sglang/kernels/ops/attention/fla/fused_norm_gate.py",
    ))

RELEASES = (VLLM, SGLANG)


def _record_hashes(wheel: zipfile.ZipFile) -> dict:
    """path -> sha256 hex, from the wheel's RECORD (urlsafe base64 without padding there)."""
    record = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
    hashes = {}
    for row in csv.reader(io.StringIO(wheel.read(record).decode())):
        if len(row) >= 2 and row[1].startswith("sha256="):
            digest = row[1][len("sha256="):]
            hashes[row[0]] = base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    return hashes


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(folder: Path) -> dict:
    """path -> sha256 of a fetched release's carried files ({} where none was fetched)."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return {}
    return {path: digest for digest, path in (line.split("  ", 1) for line in manifest.read_text().splitlines())}


def is_fetched(release: Release, base: Path = ENGINES_DIR) -> bool:
    folder = release.folder(base)
    manifest = read_manifest(folder)
    return (set(manifest) == set(release.carried)
            and all((folder / p).is_file() and _sha256(folder / p) == manifest[p] for p in release.carried))


def fetch(release: Release, base: Path = ENGINES_DIR) -> Path:
    """The release's carried files under base, downloaded and checked where not there yet."""
    folder = release.folder(base)
    if is_fetched(release, base):
        return folder
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        # the wheel for CPython 3.11 on x86-64 Linux, whatever python runs this: only its .py files are used
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                        "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--abi", "abi3",
                        "--platform", "manylinux_2_34_x86_64", "--platform", "manylinux_2_28_x86_64",
                        "-d", tmp, f"{release.engine}=={release.version}"], check=True)
        wheel_path = Path(tmp) / release.wheel
        if not wheel_path.is_file():
            raise SystemExit(f"{release.name}: pip did not download {release.wheel} (got "
                             f"{sorted(p.name for p in Path(tmp).iterdir())})")
        digest = _sha256(wheel_path)
        if digest != release.sha256:
            raise SystemExit(f"{release.name}: {release.wheel} has sha256 {digest}, pinned {release.sha256}")
        with zipfile.ZipFile(wheel_path) as wheel:
            recorded = _record_hashes(wheel)
            lines = []
            for path in release.carried:
                if path not in recorded:
                    raise SystemExit(f"{release.name}: {path} is not in {release.wheel}")
                data = wheel.read(path)
                if hashlib.sha256(data).hexdigest() != recorded[path]:
                    raise SystemExit(f"{release.name}: {path} does not match the wheel's RECORD")
                target = folder / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                lines.append(f"{recorded[path]}  {path}")
        (folder / MANIFEST).write_text("\n".join(lines) + "\n")
    return folder


def main() -> None:
    for release in RELEASES:
        was_there = is_fetched(release)
        folder = fetch(release)
        print(f"{release.name}: {len(release.carried)} kernel files in {folder.relative_to(ROOT)}"
              + (" (already there)" if was_there else " (fetched, sha256 checked)"))


if __name__ == "__main__":
    main()
