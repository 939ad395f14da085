"""fla's own Triton kernels on a CPU, under Triton's interpreter: the fidelity mode.

    from linattn.emulation import fla_interpreted

    with fla_interpreted():            # before fla is imported in this process
        from fla.ops.kda import chunk_kda
        o, s = chunk_kda(q, k, v, g, beta, ...)   # fla's kernels, interpreted: float32 CPU tensors

Beside ``fla_on_cpu`` (fla's ops replaced by the float64 references: the parity mode, fast),
this runs fla's real kernel code, each Triton program executed in numpy: slow (seconds per op at
64 tokens), float32 only, and what checks that the emulation still computes what fla computes.

The process setup (``prepare_process``; once, and the context does it when needed):

- ``TRITON_INTERPRET=1`` before fla is imported. Triton decides when a kernel is defined (at
  fla's import) whether it is interpreted, so a process that imported fla first holds compiled
  kernels, which cannot run on a CPU: refused, naming one of them.
- Triton's autotuner keeps one config, the largest tiles (fewest interpreted programs): it never
  benchmarks, which needs a GPU driver ("0 active drivers").
- The interpreter's AST pass makes ``for i in range(...)`` loop variables tensors, as compiled
  Triton does (fla calls ``i.to(tl.int64)``; the interpreter left them Python ints).
- A Triton builtin that a kernel's module binds by name (fla: ``gather = tl.gather``, in KDA's
  safe-gate kernels) gets the interpreter's semantic as ``tl.gather`` does.
- Dots accept the input precisions a CUDA backend accepts (KDA's safe gate asks ``bf16x3``); the
  interpreter computes every dot in float32 anyway.
- Load and store masks are read as booleans (the interpreter's ``scalar & block`` of two int1
  values holds int32 0/1, which its loads reject; fla's conv backward masks that way).
- Tiny kernels using all of these then run: a Triton whose internals moved fails here, in one line
  naming its version, not inside fla.

While the context is active in a process with torch.distributed initialised (spawn's ranks),
fla's CP path runs on CPU tensors: its device check (CUDA sm >= 8 or Ascend) passes CPU tensors,
and its ``all_gather_into_tensor`` gathers into the flat ``[world * n, ...]`` buffer gloo takes
(fla passes ``[world, n, ...]``, which NCCL takes). Both are put back on exit; the process setup
stays (fla's kernels stay interpreted for the process's life).

Not checked by this mode: GPU rounding (TF32 dots, fused multiply-adds, bf16 storage), races
between programs (the interpreter runs them one after another), and the tile configs a GPU
picks (one config per kernel here; fla's hardware probes are negative, so GPU-only backends are
never reached). float64 is refused by fla's kernels; bfloat16 dots are wrong in Triton 3.9's
interpreter (bf16 kept as uint16 bits): where a 16x16 bf16 dot comes out wrong at setup, a kernel
given a bfloat16 tensor raises TypeError instead of returning garbage. Use float32.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib
import inspect
import os
import sys

import torch

TRITON_WRITTEN_FOR = "3.9.0"  # the Triton whose internals the patches were written against
INTERPRET_ENV = "TRITON_INTERPRET"
# dot precisions CUDA backends accept; the interpreter computes every dot in float32 whatever it is asked
GPU_DOT_PRECISIONS = ("tf32", "tf32x3", "ieee", "bf16x3", "bf16x6")

__all__ = ["INTERPRET_ENV", "TRITON_WRITTEN_FOR", "active", "fla_interpreted", "prepare_process"]

_state = {"triton_patched": False, "process_ready": False, "bf16_refused": False, "active": 0, "cp_undo": None}


def active() -> bool:
    """Whether a `fla_interpreted` context is active in this process."""
    return _state["active"] > 0


def _triton_version() -> str:
    try:
        import triton
    except ImportError as exc:
        raise RuntimeError(f"fla_interpreted needs triton installed: {exc}") from None
    return getattr(triton, "__version__", "?")


def _fail(what: str):
    raise RuntimeError(f"fla_interpreted: Triton {_triton_version()}: {what} "
                       f"(the interpreter patches were written for Triton {TRITON_WRITTEN_FOR})")


def compiled_fla_kernel() -> str | None:
    """The name of one of fla's kernels defined compiled (fla imported before TRITON_INTERPRET=1), or None."""
    jit = sys.modules.get("triton.runtime.jit")
    if "fla" not in sys.modules or jit is None:
        return None
    for name, module in list(sys.modules.items()):
        if name != "fla" and not name.startswith("fla."):
            continue
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            while isinstance(value, jit.KernelInterface) and not isinstance(value, jit.JITFunction):
                value = getattr(value, "fn", None)  # autotune / heuristics wrappers; interpreted: a function
            if type(value) is jit.JITFunction:  # not a subclass: gluon's kernels ignore the interpreter
                return f"{name}.{attr}"
    return None


def prepare_process() -> None:
    """TRITON_INTERPRET=1 and the interpreter patches, in this process; call before fla is imported.

    Idempotent. RuntimeError (one line) when fla's kernels were already defined compiled, or when
    Triton's internals are not where the patches expect them."""
    if _state["process_ready"]:
        return
    compiled = compiled_fla_kernel()
    if compiled is not None:
        raise RuntimeError(
            f"fla_interpreted: fla was imported in this process before {INTERPRET_ENV}=1, so its kernels are "
            f"compiled (e.g. {compiled}) and cannot run on a CPU; set the process up before anything imports fla "
            f"(pytest --linattn-fla-interpreted, or linattn.emulation.interpreted.prepare_process() first)")
    os.environ[INTERPRET_ENV] = "1"
    if not _state["triton_patched"]:
        _patch_triton()
    _state["process_ready"] = True


# ----------------------------------------------------------------------------------------------
# the Triton patches


def _largest_tiles(config) -> int:
    size = 1
    for value in config.kwargs.values():
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            size *= value
    return size


def _one_config(original):
    def prune_configs(self, kwargs):
        # Triton's pruning first (fla's early_config_prune keeps only valid tiles), then one config:
        # Autotuner.run takes its single-config path and never benchmarks
        configs = original(self, kwargs)
        return [max(configs, key=_largest_tiles)] if len(configs) > 1 else configs

    prune_configs._linattn_original = original
    return prune_configs


def _range_loop_as_tensor(original):
    def visit_For(self, node):
        node = original(self, node) if original is not None else self.generic_visit(node)
        it = node.iter
        dynamic = isinstance(it, ast.Call) and (
            (isinstance(it.func, ast.Name) and it.func.id == "range")
            or (isinstance(it.func, ast.Attribute) and it.func.attr == "range"))  # tl.range; not tl.static_range
        if dynamic and isinstance(node.target, ast.Name):
            # `i = interpreter_semantic.to_tensor(i, False)` first in the body: what the
            # interpreter's own visit_Assign does to every assignment
            wrap = ast.Assign(
                targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                value=ast.Call(func=ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()),
                                                  attr="to_tensor", ctx=ast.Load()),
                               args=[ast.Name(id=node.target.id, ctx=ast.Load()), ast.Constant(value=False)],
                               keywords=[]))
            node.body.insert(0, ast.copy_location(wrap, node))
        return node

    visit_For._linattn_original = original
    return visit_For


def _builtins_bound_by_name(original, interpreter):
    """The interpreter gives `tl`'s builtins (tl.gather, ...) its semantic while a kernel runs, but
    not a builtin the kernel's module bound by name (fla.ops.utils.op: ``gather = tl.gather``, used
    by KDA's safe-gate kernels): give those the same wrapper, restored with the rest."""
    import triton.language as tl

    def _patch_lang(fn):
        scope = original(fn)
        module = sys.modules.get(getattr(fn, "__module__", None) or "")
        if module is not None and scope is not None:
            for name, member in list(vars(module).items()):
                if tl.core.is_builtin(member):
                    interpreter._patch_attr(module, name, member, interpreter.interpreter_builder, scope)
        return scope

    _patch_lang._linattn_original = original
    return _patch_lang


def _boolean_mask(original):
    """A load's or store's mask read as booleans: in Triton 3.9's interpreter ``scalar & block`` of
    two int1 values (fla's conv backward: ``(t < seq_len) & m_d``) holds int32 0/1, which its
    load and store reject ("mask has unsupported dtype")."""
    import numpy as np

    position = list(inspect.signature(original).parameters).index("mask")  # self counted

    @functools.wraps(original)
    def masked(*args):
        mask = args[position]
        if mask is not None and mask.data.dtype != np.bool_:
            args = (*args[:position], type(mask)(mask.data.astype(np.bool_), mask.dtype), *args[position + 1:])
        return original(*args)

    masked._linattn_original = original
    return masked


def _patch_triton() -> None:
    try:
        from triton.runtime import autotuner, interpreter
    except ImportError as exc:
        _fail(f"triton.runtime.autotuner / triton.runtime.interpreter do not import ({exc})")
    tuner = getattr(autotuner, "Autotuner", None)
    if tuner is None or not callable(getattr(tuner, "prune_configs", None)):
        _fail("triton.runtime.autotuner.Autotuner.prune_configs is not there")
    transformer = getattr(interpreter, "ASTTransformer", None)
    rewriter = getattr(interpreter, "FunctionRewriter", None)
    if transformer is None or not isinstance(getattr(rewriter, "ast_transformer", None), transformer):
        _fail("triton.runtime.interpreter.FunctionRewriter.ast_transformer is not an ASTTransformer")
    if not callable(getattr(getattr(interpreter, "interpreter_semantic", None), "to_tensor", None)):
        _fail("triton.runtime.interpreter.interpreter_semantic.to_tensor is not there")
    for name in ("_patch_lang", "_patch_attr", "interpreter_builder"):
        if not hasattr(interpreter, name):
            _fail(f"triton.runtime.interpreter.{name} is not there")
    builder_options = getattr(interpreter.interpreter_builder, "options", None)
    if not isinstance(getattr(builder_options, "allowed_dot_input_precisions", None), tuple):
        _fail("triton.runtime.interpreter.interpreter_builder.options.allowed_dot_input_precisions is not there")
    builder_class = type(interpreter.interpreter_builder)
    for name in ("create_masked_load", "create_masked_store"):
        method = builder_class.__dict__.get(name)
        if not callable(method) or "mask" not in inspect.signature(method).parameters:
            _fail(f"triton.runtime.interpreter.{builder_class.__name__}.{name}(..., mask, ...) is not there")
    function = getattr(interpreter, "InterpretedFunction", None)
    if not callable(getattr(function, "run", None)):
        _fail("triton.runtime.interpreter.InterpretedFunction.run is not there")
    prune, visit = tuner.__dict__.get("prune_configs"), transformer.__dict__.get("visit_For")
    patch_lang = interpreter._patch_lang
    tuner.prune_configs = _one_config(prune)
    transformer.visit_For = _range_loop_as_tensor(visit)
    interpreter._patch_lang = _builtins_bound_by_name(patch_lang, interpreter)
    masked = {name: builder_class.__dict__[name] for name in ("create_masked_load", "create_masked_store")}
    for name, original in masked.items():
        setattr(builder_class, name, _boolean_mask(original))
    allowed = builder_options.allowed_dot_input_precisions
    interpreter.interpreter_builder.options = dataclasses.replace(
        builder_options, allowed_dot_input_precisions=allowed + tuple(p for p in GPU_DOT_PRECISIONS if p not in allowed))
    try:
        from . import _interpreter_check

        _interpreter_check.run()
        guarded = hasattr(function.run, "_linattn_original")  # patched before: its check would be refused
        bf16_right = not _state["bf16_refused"] if guarded else _interpreter_check.bf16_dot_is_right()
    except Exception as exc:
        tuner.prune_configs, interpreter._patch_lang = prune, patch_lang
        for name, original in masked.items():
            setattr(builder_class, name, original)
        interpreter.interpreter_builder.options = builder_options
        if visit is None:
            del transformer.visit_For
        else:
            transformer.visit_For = visit
        first_line = (str(exc).strip().splitlines() or [""])[0]
        _fail(f"the patched interpreter fails its self-check kernels: {type(exc).__name__}: {first_line}")
    if not bf16_right and not guarded:
        # a silently wrong result otherwise (Triton 3.9: 1e10 relative on chunk_gated_delta_rule)
        function.run = _refusing_bf16(function.run, _triton_version())
    _state["triton_patched"], _state["bf16_refused"] = True, not bf16_right


def _refusing_bf16(original, version):
    def run(self, *args, **kwargs):
        named = list(zip(getattr(self, "arg_names", ()), args)) + list(kwargs.items())
        for name, value in named:
            if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
                raise TypeError(f"fla_interpreted: kernel {self.__name__} got a bfloat16 tensor ({name}): Triton "
                                f"{version}'s interpreter computes bfloat16 dots wrong; run fla's kernels in float32")
        return original(self, *args, **kwargs)

    run._linattn_original = original
    return run


# ----------------------------------------------------------------------------------------------
# fla's CP path on CPU tensors over gloo


def _all_gather_flat(inp, out=None, group=None, async_op=False):
    """fla.ops.cp.comm.all_gather_into_tensor's contract (out ``[world, *inp.shape]``), gathered
    through a ``[world * n, ...]`` view of out, the shape gloo accepts."""
    import torch.distributed as dist

    world = dist.get_world_size(group=group)
    if out is None:
        out = torch.empty(world, *inp.shape, device=inp.device, dtype=inp.dtype)
    flat = out.view(world * inp.shape[0], *inp.shape[1:]) if inp.dim() else out.view(world)
    handle = dist.all_gather_into_tensor(flat, inp.contiguous(), group=group, async_op=async_op)
    return out, handle


def _patch_cp(fla) -> list:
    """Rebind fla's CP device check and all-gather in every fla module holding them; undo records."""
    for name in ("fla.ops.cp", "fla.modules.causal_conv1d.cp"):
        importlib.import_module(name)
    context, comm = sys.modules["fla.ops.cp.context"], sys.modules.get("fla.ops.cp.comm")
    check = getattr(context, "_check_cp_device", None)
    gather = getattr(comm, "all_gather_into_tensor", None)
    if check is None or gather is None:
        raise RuntimeError(
            f"fla_interpreted: fla {getattr(fla, '__version__', '?')}: fla.ops.cp.context._check_cp_device or "
            f"fla.ops.cp.comm.all_gather_into_tensor is not there (the CP patches were written for fla 0.6.0)")

    def check_cp_device(device):
        if torch.device(device).type != "cpu":
            check(device)

    swaps = {id(check): (check, check_cp_device), id(gather): (gather, _all_gather_flat)}
    undo = []
    for name, module in list(sys.modules.items()):
        if name == "fla" or name.startswith("fla."):
            namespace = getattr(module, "__dict__", {})
            for attr, value in list(namespace.items()):
                hit = swaps.get(id(value))
                if hit is not None and hit[0] is value:
                    namespace[attr] = hit[1]
                    undo.append((namespace, attr, value))
    return undo


def _import_fla():
    try:
        import fla
    except ImportError as exc:
        raise ImportError(f"fla_interpreted needs fla installed (flash-linear-attention, fla-core, triton): {exc}") from exc
    return fla


@contextlib.contextmanager
def fla_interpreted():
    """While active, fla's kernels run under Triton's interpreter in this process (float32 CPU
    tensors); set up with `prepare_process` on first use, so enter it before fla is imported (or
    run pytest with ``--linattn-fla-interpreted``). In a process with torch.distributed
    initialised, fla's CP path is patched to run on CPU tensors over gloo while active.

    It does not replace fla's ops: under ``fla_on_cpu`` too, the emulated ops compute and only the
    rest of fla's kernels are interpreted (how the fidelity suite compares the two)."""
    if _state["active"] == 0:
        prepare_process()
        fla = _import_fla()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            _state["cp_undo"] = _patch_cp(fla)
    _state["active"] += 1
    try:
        yield
    finally:
        _state["active"] -= 1
        if _state["active"] == 0 and _state["cp_undo"] is not None:
            for namespace, attr, value in reversed(_state["cp_undo"]):
                namespace[attr] = value
            _state["cp_undo"] = None
