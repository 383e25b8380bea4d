"""The house rules of issue 38 that code can check: imports point one way, process-wide switches are
context variables, and the interpreter patch refuses a jax it was not written for."""

from __future__ import annotations

import ast
import re
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nybble

ROOT = Path(__file__).resolve().parents[1]


def _nybble_imports(path: Path) -> set[str]:
    """The nybble modules a source file imports (any nesting: a lazy import counts too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("nybble")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nybble"):
            found.add(node.module)
    return found


@pytest.mark.parametrize("package", ["kernels", "packing", "quant"])
def test_lower_layers_never_import_upper_ones(package):
    """``nybble.kernels`` is below ``nybble.sharding`` (which runs it per shard) and ``nybble.ops`` (the
    weight-type dispatch); packing and quant below both: none of their files imports sharding, ops,
    models or the checkpoint, not even lazily (``kernels/xray`` is the X-ray's, on its way to bench)."""
    upper = ("nybble.sharding", "nybble.ops", "nybble.models", "nybble.checkpoint")
    files = [p for p in (ROOT / "nybble" / package).rglob("*.py") if "xray" not in p.parts]
    assert files
    bad = {
        str(p.relative_to(ROOT)): sorted(m for m in _nybble_imports(p) if m.startswith(upper)) for p in files
    }
    assert not {k: v for k, v in bad.items() if v}


# nybble/models/ by role, each folder importing only the roles below it (a lazy import counts too).
MODEL_ROLES_BELOW = {
    "definitions": (),
    "quantization": ("definitions",),
    "placement": ("definitions", "quantization"),
    "io": ("definitions", "quantization", "placement"),
    "evaluate": ("definitions", "io"),
}


@pytest.mark.parametrize("role", list(MODEL_ROLES_BELOW))
def test_model_roles_import_only_the_roles_below(role):
    """The model definitions import no quantization pass, reader, writer, placement or evaluation; the
    quantization passes no reader or writer; and no file under ``nybble/models/`` imports the package face
    (``nybble.models``) or ``nybble`` itself: arrows from below point at the module that defines a name."""
    models = ROOT / "nybble" / "models"
    assert sorted(p.name for p in models.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
        MODEL_ROLES_BELOW
    )
    assert sorted(p.name for p in models.glob("*.py")) == ["__init__.py"]  # every module sits in its role
    allowed = {role, *MODEL_ROLES_BELOW[role]}
    files = list((models / role).rglob("*.py"))
    assert files
    bad = {}
    for path in files:
        for m in _nybble_imports(path):
            parts = m.split(".")
            if m in ("nybble", "nybble.models") or (
                parts[:2] == ["nybble", "models"] and parts[2] not in allowed
            ):
                bad.setdefault(str(path.relative_to(ROOT)), []).append(m)
    assert not bad


def test_model_modules_import_nybble_at_the_top():
    """Imports of nybble modules under ``nybble/models/`` sit at the top of the file, where they show the
    arrows (none breaks a cycle: the roles' order has none); only ``__init__``'s missing-extra message is
    imported where the error is raised."""
    nested = []
    for path in (ROOT / "nybble" / "models").rglob("*.py"):
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            is_import = isinstance(node, ast.Import | ast.ImportFrom)
            if is_import and id(node) not in top and any(m.startswith("nybble") for m in _names(node)):
                nested.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert nested == ["nybble/models/__init__.py:13"]


def _names(node: ast.Import | ast.ImportFrom) -> list[str]:
    return [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]


SEAM = {
    "unsupported": ["x", "qw"],
    "not_here": [],
    "matmul": ["x2d", "qw"],
    "describe": ["m", "qw"],
    "ragged_unsupported": ["x", "qw", "group_sizes"],
    "ragged_matmul": ["x", "qw", "group_sizes"],
}


@pytest.mark.parametrize("name", list(nybble.kernels.backends.BACKENDS))
def test_every_registered_backend_plugs_into_the_seam(name):
    """Each backend module defines the six functions the registry calls, taking the seam's arguments
    (positionally: their names are the backend's)."""
    import inspect

    backend = nybble.kernels.backends.load(name)
    assert not isinstance(backend, str), backend
    for function, params in SEAM.items():
        signature = inspect.signature(getattr(backend, function))
        signature.bind(*params)
        with pytest.raises(TypeError):
            signature.bind(*params, "one too many")


def test_ops_reach_backends_only_through_the_registry():
    """The ops (``kernels/ops``) and the registry import no backend's package: a backend is one line of
    ``backends.BACKENDS``. And no backend imports an op's face (``api.py``): the op calls the backend."""
    kernels = ROOT / "nybble" / "kernels"
    packages = ("nybble.kernels.mosaic_gpu", "nybble.kernels.triton")
    for path in [kernels / "backends.py", *(kernels / "ops").rglob("*.py")]:
        assert not [m for m in _nybble_imports(path) if m.startswith(packages)], path
    for path in [p for p in kernels.rglob("*.py") if "ops" not in p.parts and p.name != "__init__.py"]:
        assert not [m for m in _nybble_imports(path) if m.endswith(".api")], path


def test_ops_dispatches_by_weight_type():
    from jax.sharding import Mesh

    from nybble.sharding import TensorParallel, shard_weight

    qw = nybble.quantize(np.arange(128 * 64, dtype=np.float32).reshape(128, 64) / 1e3, group_size=64)
    x = jnp.ones((2, 128), jnp.float32)
    sw = shard_weight(
        qw, TensorParallel(Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model")), "row")
    )
    np.testing.assert_array_equal(np.asarray(nybble.matmul(x, sw)), np.asarray(nybble.matmul(x, qw)))
    with pytest.raises(TypeError, match=r"a ShardedWeight goes through nybble\.matmul"):
        nybble.kernels.matmul(x, sw)
    with pytest.raises(ValueError, match="unknown implementation 'cuda'"):
        nybble.matmul(x, sw, implementation="cuda")  # type: ignore[arg-type]


def test_an_injected_kernel_bug_stays_in_its_context():
    from tests import kernel_faults as faults

    seen = []

    def other_thread():
        seen.append(faults.injected())

    with faults.injecting("last-n-tile-zero"):
        assert faults.injected() == "last-n-tile-zero"
        t = threading.Thread(target=other_thread)  # a new thread starts from the default context
        t.start()
        t.join()
    assert seen == [None] and faults.injected() is None
    with pytest.raises(ValueError, match="unknown kernel bug 'off-by-one'"):
        with faults.injecting("off-by-one"):
            pass


def test_kernel_modules_hold_no_test_machinery():
    """Deliberate bugs are the tests' (tests/kernel_faults.py swaps functions the kernel calls): no
    production module names them."""
    words = re.compile(r"\bfaults?\b|\binject|deliberate bug", re.IGNORECASE)
    found = {
        str(p.relative_to(ROOT)): words.findall(p.read_text())
        for p in (ROOT / "nybble" / "kernels").rglob("*.py")
    }
    assert not {k: v for k, v in found.items() if v}


def test_interpret_refuses_a_jax_outside_the_range(monkeypatch):
    from nybble.kernels.mosaic_gpu import interpret as interp

    for inside in ("0.11.2", "0.12.0.1", "0.12.1"):
        interp.check_jax_version(inside)
    for outside in ("0.11.1", "0.13.0", "0.13.0.dev20270101", "1.0"):
        with pytest.raises(
            RuntimeError,
            match=rf"patches private functions .* nybble supports jax>=0\.11\.2,<0\.13 \(tested with jax "
            rf"0\.11\.2, 0\.12\.0\.1 and 0\.12\.1\) and this is jax {re.escape(outside)}",
        ):
            interp.check_jax_version(outside)
    monkeypatch.setattr(jax, "__version__", "0.13.0")
    qw = nybble.quantize(np.ones((128, 64), np.float32), group_size=64)
    with pytest.raises(RuntimeError, match=r"this is jax 0\.13\.0"):
        with nybble.kernels.interpret():
            nybble.matmul(jnp.ones((8, 128), jnp.bfloat16), qw, implementation="mosaic_gpu")


def test_register_a_wgmma_patched_only_where_the_interpreter_lacks_it():
    """jax 0.12.1's interpreter runs a WGMMA whose A operand is in registers by itself; 0.11.2's and
    0.12.0.1's fail on it ("Expected shape (6,)"), and nybble's context patches that method there only."""
    from jax._src.pallas.mosaic_gpu.interpret import jaxpr_interpret

    from nybble.kernels.mosaic_gpu import interpret as interp

    native = interp.native_register_a()
    assert native == (jax.__version__ not in ("0.11.2", "0.12.0.1"))
    before = jaxpr_interpret.JaxprInterpreter._interpret_wgmma_ref_p
    with nybble.kernels.interpret():
        inside = jaxpr_interpret.JaxprInterpreter._interpret_wgmma_ref_p
    assert (inside is before) == native and (inside is interp._patched_wgmma_ref_p) == (not native)
    assert jaxpr_interpret.JaxprInterpreter._interpret_wgmma_ref_p is before


def test_interpret_refuses_an_interpreter_without_its_patch_targets(monkeypatch):
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    from nybble.kernels.mosaic_gpu import interpret as interp

    monkeypatch.delattr(gpu_callbacks, "call_allocate_buffer")
    with pytest.raises(RuntimeError, match=r"lacks gpu_callbacks\.call_allocate_buffer: install one of"):
        interp.check_jax_version()
